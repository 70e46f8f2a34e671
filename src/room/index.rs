//! Which activities have a room, known in process: an existing activity
//! without one costs a map lookup, and an id without one is answered from
//! an index of the rooms read as a whole, never with a query of its own.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Rooms, repo};
use crate::domain::ActivityId;
use crate::store;

/// How long a room's row is trusted in process.
pub(super) const ROW_TTL: Duration = Duration::from_secs(2);

/// What is known of an existing activity's room.
#[derive(Clone)]
pub(super) enum Known {
    /// The activity exists and has no room: true for good (a room is
    /// chosen at creation only).
    NoRoom,
    /// Its room, as read then.
    Room(Instant, Arc<repo::LiveRoom>),
}

/// The activities that have a room, read as a whole: an id not among them
/// is answered "no room" without a query, however many random ids a
/// client makes up.
pub(super) struct Index {
    read_at: Instant,
    /// [`Rooms::forget`]'s generation when it was read.
    generation: u64,
    pub(super) ids: HashSet<ActivityId>,
}

impl Rooms {
    /// The room of `activity` with its window, `None` without one (or
    /// without such an activity). Whether an activity has a room never
    /// changes: "none" is read once per process for an existing activity,
    /// so one without a room costs a map lookup on its token route, and an
    /// id without a room is answered from the index of rooms, with no
    /// query of its own. A room's row is read again after [`ROW_TTL`] (its
    /// end and whether its queue was opened can move).
    pub async fn room(&self, activity: ActivityId) -> anyhow::Result<Option<Arc<repo::LiveRoom>>> {
        self.lookup(activity, false).await
    }

    /// The room of an activity known to exist (the token route, once Redis
    /// holds it warm): the index is not believed, or one read before its
    /// creation on another instance would let its tokens go without a
    /// pass.
    pub async fn room_of_existing(
        &self,
        activity: ActivityId,
    ) -> anyhow::Result<Option<Arc<repo::LiveRoom>>> {
        self.lookup(activity, true).await
    }

    async fn lookup(
        &self,
        activity: ActivityId,
        exists: bool,
    ) -> anyhow::Result<Option<Arc<repo::LiveRoom>>> {
        let cached = self
            .known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&activity)
            .cloned();
        match cached {
            Some(Known::NoRoom) => return Ok(None),
            Some(Known::Room(at, room)) if at.elapsed() < ROW_TTL => return Ok(Some(room)),
            _ => {}
        }
        if !exists && !self.indexed().await?.ids.contains(&activity) {
            return Ok(None);
        }
        self.metrics.room_lookups.with_label_values(&["row"]).inc();
        let (found, exists) = store::run(&self.public, move |conn| {
            let found = repo::find_live(conn, activity)?;
            let exists =
                found.is_some() || crate::activities::repo::find(conn, activity)?.is_some();
            Ok((found, exists))
        })
        .await?;
        let found = found.map(Arc::new);
        let known = match (&found, exists) {
            (Some(room), _) => Known::Room(Instant::now(), room.clone()),
            (None, true) => Known::NoRoom,
            // No such activity (deleted since): nothing kept.
            (None, false) => return Ok(None),
        };
        self.known
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(activity, known);
        Ok(found)
    }

    /// The index of rooms, read again when older than [`ROW_TTL`] or
    /// read before a room was created here.
    pub(super) async fn indexed(&self) -> anyhow::Result<Arc<Index>> {
        let mut index = self.index.lock().await;
        let generation = self.generation.load(Ordering::Acquire);
        if let Some(i) = index
            .as_ref()
            .filter(|i| i.generation == generation && i.read_at.elapsed() < ROW_TTL)
        {
            return Ok(i.clone());
        }
        self.metrics
            .room_lookups
            .with_label_values(&["index"])
            .inc();
        let ids = store::run(&self.public, |conn| Ok(repo::ids(conn)?)).await?;
        let fresh = Arc::new(Index {
            read_at: Instant::now(),
            generation,
            ids: ids.into_iter().collect(),
        });
        *index = Some(fresh.clone());
        Ok(fresh)
    }

    /// Forgets what is cached of `activity` (its room was just created or
    /// its epoch moved).
    pub fn forget(&self, activity: ActivityId) {
        self.known
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&activity);
        // A room created here is in this instance's next index at once.
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}
