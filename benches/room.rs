//! The waiting room's CPU work per request, without I/O: a ticket's place
//! in a drawn pre-queue of a million (and its inverse, the admitter's), a
//! pass checked on the token route, a proof-of-work answer checked on join;
//! and, once per queue on each instance, the entrants' Merkle tree built
//! at the close (200,000 entrants) and a buyer's proof read from it.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use seckill::domain::{ActivityId, UserId};
use seckill::room::draw::Draw;
use seckill::room::entrants::{Salts, Tree};
use seckill::room::pass::{Kind, Pass, Passes};
use seckill::room::pow::{self, Puzzles};

fn room(c: &mut Criterion) {
    let draw = Draw::new(&[7u8; 32], "commitment", 1_000_000);
    let mut i = 0u64;
    c.bench_function("draw: place of a ticket among 1,000,000", |b| {
        b.iter(|| {
            i = (i + 7_919) % 1_000_000;
            black_box(draw.position(black_box(i)))
        })
    });
    c.bench_function("draw: ticket at a place among 1,000,000", |b| {
        b.iter(|| {
            i = (i + 7_919) % 1_000_000;
            black_box(draw.ticket_at(black_box(i)))
        })
    });

    let salts = Salts::new(b"bench key");
    let users: Vec<i64> = (0..200_000).map(|u| 10_000_000 + u * 13).collect();
    let mut group = c.benchmark_group("entrants");
    group.sample_size(10);
    group.bench_function("tree of 200,000 entrants built (once per queue)", |b| {
        b.iter(|| {
            black_box(Tree::build(
                &salts,
                ActivityId::new(7),
                1,
                black_box(&users),
            ))
        })
    });
    group.finish();
    let tree = Tree::build(&salts, ActivityId::new(7), 1, &users);
    c.bench_function("entrants: a ticket's proof among 200,000", |b| {
        b.iter(|| {
            i = (i + 7_919) % 200_000;
            black_box(tree.proof(black_box(i + 1)))
        })
    });

    let passes = Passes::new(b"bench key");
    let user = UserId::parse("42").unwrap();
    let raw = passes.sign(&Pass {
        activity: ActivityId::new(7),
        user,
        ticket: 123_456,
        epoch: 1,
        kind: Kind::Admitted,
        expires_ms: i64::MAX,
    });
    c.bench_function("pass: signature, user, activity and expiry checked", |b| {
        b.iter(|| black_box(passes.check(black_box(&raw), ActivityId::new(7), user, 0)))
    });

    let puzzles = Puzzles::new("bench key".into());
    let now = chrono::Utc::now();
    let challenge = puzzles
        .challenge(
            ActivityId::new(7),
            user,
            1_000,
            now + chrono::Duration::minutes(5),
        )
        .unwrap();
    let answer = pow::solve(&challenge).unwrap();
    c.bench_function("proof of work: an answer checked", |b| {
        b.iter(|| black_box(puzzles.check(black_box(&answer), ActivityId::new(7), user, now)))
    });
    c.bench_function(
        "proof of work: solving maxnumber 50,000 (the default), in Rust",
        |b| {
            let hard = puzzles
                .challenge(
                    ActivityId::new(7),
                    user,
                    50_000,
                    now + chrono::Duration::minutes(5),
                )
                .unwrap();
            b.iter(|| black_box(pow::solve(&hard)))
        },
    );
}

criterion_group!(benches, room);
criterion_main!(benches);
