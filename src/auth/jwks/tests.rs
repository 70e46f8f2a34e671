use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;

use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{EncodingKey, Header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const ISSUER: &str = "https://id.example.test";
const AUDIENCE: &str = "seckill";

/// A key made now, as an identity provider holds it.
struct Signer {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    public: Jwk,
    /// The public key as PEM-less DER bytes, for the HS256 confusion.
    public_bytes: Vec<u8>,
}

fn rsa_signer(kid: &str) -> Signer {
    use rsa::pkcs1::{EncodeRsaPrivateKey, EncodeRsaPublicKey};
    use rsa::{Generate, PrivateKey};
    let key = PrivateKey::generate();
    let der = key.to_pkcs1_der().expect("pkcs1");
    let encoding = EncodingKey::from_rsa_der(der.as_bytes());
    let public_bytes = key
        .to_public_key()
        .to_pkcs1_der()
        .expect("public pkcs1")
        .as_bytes()
        .to_vec();
    signer(kid, Algorithm::RS256, encoding, public_bytes)
}

fn ec_signer(kid: &str) -> Signer {
    use p256::pkcs8::EncodePrivateKey;
    let key = loop {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).expect("random bytes");
        if let Ok(key) = p256::SecretKey::from_slice(&bytes) {
            break key;
        }
    };
    let der = key.to_pkcs8_der().expect("pkcs8");
    let encoding = EncodingKey::from_ec_der(der.as_bytes());
    let public_bytes = key.public_key().to_sec1_bytes().to_vec();
    signer(kid, Algorithm::ES256, encoding, public_bytes)
}

fn signer(kid: &str, alg: Algorithm, encoding: EncodingKey, public_bytes: Vec<u8>) -> Signer {
    let mut public = Jwk::from_encoding_key(&encoding, alg).expect("public jwk");
    public.common.key_id = Some(kid.to_owned());
    Signer {
        kid: kid.to_owned(),
        alg,
        encoding,
        public,
        public_bytes,
    }
}

fn claims(sub: &str) -> serde_json::Value {
    let now = chrono::Utc::now().timestamp();
    serde_json::json!({"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "exp": now + 300, "iat": now})
}

impl Signer {
    fn token(&self, claims: &serde_json::Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.encoding).expect("sign")
    }
}

/// An identity provider's JWKS and discovery document over HTTP on
/// loopback, counting the JWKS fetches.
struct Provider {
    base: String,
    published: Arc<Mutex<Vec<Jwk>>>,
    fetches: Arc<AtomicUsize>,
    mode: Arc<AtomicUsize>,
}

/// How the provider answers a JWKS fetch.
#[derive(Clone, Copy)]
enum Answer {
    Keys = 0,
    /// 500 at once.
    Fails = 1,
    /// Nothing for a minute: a provider that hangs.
    Hangs = 2,
}

impl Provider {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let published: Arc<Mutex<Vec<Jwk>>> = Arc::default();
        let fetches = Arc::new(AtomicUsize::new(0));
        let mode = Arc::new(AtomicUsize::new(Answer::Keys as usize));
        let (keys, count, issuer) = (published.clone(), fetches.clone(), base.clone());
        let how = mode.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (keys, count, issuer, how) =
                    (keys.clone(), count.clone(), issuer.clone(), how.clone());
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&request)
                        .lines()
                        .next()
                        .unwrap_or("")
                        .to_owned();
                    let mut status = "200 OK";
                    let body = if line.contains("/.well-known/openid-configuration") {
                        serde_json::json!({"issuer": issuer, "jwks_uri": format!("{issuer}/jwks")})
                    } else {
                        count.fetch_add(1, Ordering::SeqCst);
                        match how.load(Ordering::SeqCst) {
                            1 => status = "500 Internal Server Error",
                            2 => tokio::time::sleep(Duration::from_secs(60)).await,
                            _ => {}
                        }
                        let keys = keys.lock().unwrap().clone();
                        serde_json::json!({"keys": keys})
                    }
                    .to_string();
                    let reply = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(reply.as_bytes()).await;
                });
            }
        });
        Self {
            base,
            published,
            fetches,
            mode,
        }
    }

    fn publish(&self, signers: &[&Signer]) {
        *self.published.lock().unwrap() = signers.iter().map(|s| s.public.clone()).collect();
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }

    fn jwks(&self, ttl: Duration, cooldown: Duration) -> Arc<Jwks> {
        Arc::new(
            Jwks::new(JwksConfig {
                source: JwksSource::Jwks(format!("{}/jwks", self.base)),
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                ttl,
                cooldown,
            })
            .unwrap(),
        )
    }

    /// From now on, each JWKS fetch is answered as `answer` says.
    fn answer(&self, answer: Answer) {
        self.mode.store(answer as usize, Ordering::SeqCst);
    }
}

const LONG: Duration = Duration::from_secs(3600);

#[tokio::test]
async fn rs256_and_es256_tokens_of_the_published_keys_are_accepted() {
    let provider = Provider::start().await;
    let (rsa, ec) = (rsa_signer("r1"), ec_signer("e1"));
    provider.publish(&[&rsa, &ec]);
    let jwks = provider.jwks(LONG, LONG);
    assert_eq!(
        jwks.verify(&rsa.token(&claims("7"))).await,
        Ok((UserId::parse("7").unwrap(), Role::User)),
        "no role claim: a buyer"
    );
    let mut admin = claims("8");
    admin["role"] = "admin".into();
    assert_eq!(
        jwks.verify(&ec.token(&admin)).await,
        Ok((UserId::parse("8").unwrap(), Role::Admin))
    );
    let mut listed = claims("9");
    listed["aud"] = serde_json::json!(["other", AUDIENCE]);
    assert!(
        jwks.verify(&rsa.token(&listed)).await.is_ok(),
        "aud as a list naming us"
    );
    assert_eq!(provider.fetches(), 1, "one fetch serves every known key");
}

#[tokio::test]
async fn a_forged_or_foreign_token_is_refused() {
    let provider = Provider::start().await;
    let rsa = rsa_signer("r1");
    let ec = ec_signer("e1");
    provider.publish(&[&rsa, &ec]);
    let jwks = provider.jwks(LONG, LONG);
    let refused = |token: String, why: &'static str| {
        let jwks = &jwks;
        async move {
            let answer = jwks.verify(&token).await;
            assert!(answer.is_err(), "{why}: {answer:?}");
        }
    };
    // alg none, unsigned.
    let b64 = |v: serde_json::Value| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    let none = format!(
        "{}.{}.",
        b64(serde_json::json!({"alg": "none", "kid": "r1", "typ": "JWT"})),
        b64(claims("7"))
    );
    refused(none, "alg none").await;
    // HS256 keyed with the RSA public key's bytes.
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("r1".into());
    let confused = jsonwebtoken::encode(
        &header,
        &claims("7"),
        &EncodingKey::from_secret(&rsa.public_bytes).unwrap(),
    )
    .unwrap();
    refused(confused, "HS256 over the public key").await;
    // ES256 claimed over the RSA key's kid.
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("r1".into());
    refused(
        jsonwebtoken::encode(&header, &claims("7"), &ec.encoding).unwrap(),
        "another key's kid",
    )
    .await;
    for (field, value, why) in [
        ("aud", serde_json::json!("someone-else"), "wrong aud"),
        (
            "iss",
            serde_json::json!("https://evil.example"),
            "wrong iss",
        ),
        (
            "exp",
            serde_json::json!(chrono::Utc::now().timestamp() - 120),
            "expired",
        ),
        (
            "nbf",
            serde_json::json!(chrono::Utc::now().timestamp() + 120),
            "not yet valid",
        ),
        (
            "sub",
            serde_json::json!("alice"),
            "a subject that is not a user id",
        ),
    ] {
        let mut c = claims("7");
        c[field] = value;
        refused(rsa.token(&c), why).await;
    }
    let mut c = claims("7");
    c.as_object_mut().unwrap().remove("aud");
    refused(rsa.token(&c), "no aud").await;
    // Signed by a key the provider never published.
    refused(
        rsa_signer("r1").token(&claims("7")),
        "another key under a known kid",
    )
    .await;
    let mut no_kid = Header::new(Algorithm::RS256);
    no_kid.kid = None;
    refused(
        jsonwebtoken::encode(&no_kid, &claims("7"), &rsa.encoding).unwrap(),
        "no kid",
    )
    .await;
}

#[tokio::test]
async fn made_up_kids_cost_one_fetch_per_cooldown() {
    let provider = Provider::start().await;
    let rsa = rsa_signer("r1");
    provider.publish(&[&rsa]);
    let jwks = Arc::new(provider.jwks(LONG, LONG));
    assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
    assert_eq!(provider.fetches(), 1);
    // 1,000 tokens with random kids, 100 at a time.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000 {
        let jwks = jwks.clone();
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(format!("made-up-{i}-{}", fastrand::u64(..)));
        let token = jsonwebtoken::encode(&header, &claims("7"), &rsa.encoding).unwrap();
        tasks.spawn(async move { jwks.verify(&token).await.is_err() });
        if tasks.len() >= 100 {
            assert!(tasks.join_next().await.unwrap().unwrap(), "refused");
        }
    }
    while let Some(refused) = tasks.join_next().await {
        assert!(refused.unwrap(), "refused");
    }
    assert!(
        provider.fetches() <= 2,
        "{} fetches for 1,000 made-up kids within one cooldown",
        provider.fetches()
    );
    assert!(
        jwks.verify(&rsa.token(&claims("7"))).await.is_ok(),
        "the real key still works"
    );
}

#[tokio::test]
async fn a_rotated_key_is_accepted_after_one_fetch_and_a_removed_one_refused() {
    let provider = Provider::start().await;
    let (old, new) = (rsa_signer("old"), ec_signer("new"));
    provider.publish(&[&old]);
    // No cooldown: every unknown kid may fetch (the storm test holds it).
    let jwks = provider.jwks(LONG, Duration::ZERO);
    let old_token = old.token(&claims("7"));
    assert!(jwks.verify(&old_token).await.is_ok());
    assert_eq!(provider.fetches(), 1);
    // The provider adds a key and signs with it.
    provider.publish(&[&old, &new]);
    assert!(
        jwks.verify(&new.token(&claims("7"))).await.is_ok(),
        "the new kid"
    );
    assert_eq!(provider.fetches(), 2, "one fetch for the new kid");
    assert!(
        jwks.verify(&old_token).await.is_ok(),
        "the old key is still published"
    );
    assert_eq!(provider.fetches(), 2, "known keys cost no fetch");
    // The provider removes the old key; the next fetch drops it.
    let newer = rsa_signer("newer");
    provider.publish(&[&new, &newer]);
    assert!(jwks.verify(&newer.token(&claims("7"))).await.is_ok());
    assert_eq!(provider.fetches(), 3);
    assert!(
        jwks.verify(&old_token).await.is_err(),
        "the removed key is refused"
    );
}

#[tokio::test]
async fn a_stale_set_is_fetched_again_and_discovery_finds_the_jwks() {
    let provider = Provider::start().await;
    let rsa = rsa_signer("r1");
    provider.publish(&[&rsa]);
    let jwks = Arc::new(
        Jwks::new(JwksConfig {
            source: JwksSource::Discovery(provider.base.clone()),
            issuer: ISSUER.into(),
            audience: AUDIENCE.into(),
            ttl: Duration::ZERO,
            cooldown: LONG,
        })
        .unwrap(),
    );
    assert!(
        jwks.verify(&rsa.token(&claims("7"))).await.is_ok(),
        "found by discovery"
    );
    assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
    fetched(&provider, 2, "a set past its TTL is fetched again").await;
    // An issuer whose document names another issuer is not trusted.
    let wrong = Arc::new(
        Jwks::new(JwksConfig {
            source: JwksSource::Discovery(format!("{}/other", provider.base)),
            issuer: ISSUER.into(),
            audience: AUDIENCE.into(),
            ttl: LONG,
            cooldown: LONG,
        })
        .unwrap(),
    );
    assert!(wrong.verify(&rsa.token(&claims("7"))).await.is_err());
}

/// Waits (a minute at most) until the provider has been asked `n`
/// times: a background fetch lands when it lands.
async fn fetched(provider: &Provider, n: usize, what: &str) {
    for _ in 0..600 {
        if provider.fetches() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(provider.fetches(), n, "{what}");
}

/// An identity provider that hangs past the set's TTL holds no
/// request whose key is known: each is verified with the set in hand,
/// and one fetch at a time goes on in the background.
#[tokio::test]
async fn a_hung_provider_never_holds_a_token_of_a_known_key() {
    let provider = Provider::start().await;
    let rsa = rsa_signer("r1");
    provider.publish(&[&rsa]);
    let jwks = provider.jwks(Duration::ZERO, LONG);
    assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
    provider.answer(Answer::Hangs);
    let token = rsa.token(&claims("7"));
    for round in 0..2 {
        let verified = tokio::time::timeout(
            Duration::from_secs(30),
            futures_util::future::join_all((0..20).map(|_| jwks.verify(&token))),
        )
        .await
        .expect("no request waits for the hung fetch");
        assert!(verified.iter().all(Result::is_ok), "round {round}");
        fetched(
            &provider,
            2,
            "one fetch in the background, not one per request",
        )
        .await;
    }
}

/// A provider that fails is asked again only after a backoff, not by
/// every request that finds the set stale.
#[tokio::test]
async fn a_failing_provider_is_asked_again_only_after_a_backoff() {
    let provider = Provider::start().await;
    let rsa = rsa_signer("r1");
    provider.publish(&[&rsa]);
    let jwks = provider.jwks(Duration::ZERO, LONG);
    assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
    provider.answer(Answer::Fails);
    assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
    fetched(&provider, 2, "the stale set is fetched again").await;
    // Whether that fetch is still under way or has failed, no request
    // starts another.
    for _ in 0..50 {
        assert!(
            jwks.verify(&rsa.token(&claims("7"))).await.is_ok(),
            "the last set stays in use"
        );
    }
    assert_eq!(provider.fetches(), 2, "no fetch before the backoff");
}
