//! Redis over TLS (issue 33 item 4): a `redis-server` that speaks only TLS,
//! with a CA, a server and a client certificate this test makes; reached
//! with the CA given, with a client certificate (mutual TLS), and refused
//! with a typed error when the CA is another or a PEM is bad; the same from
//! the environment.
#![cfg(feature = "redis-tls")]

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::managed::{SentinelSetup, TlsCluster, TlsNode};
use support::{Oops, Runs};
use throttlebeam::store::{
    REDIS_CA_FILE_ENV, REDIS_CLIENT_CERT_FILE_ENV, REDIS_CLIENT_KEY_FILE_ENV, REDIS_CLUSTER_ENV,
    REDIS_PASSWORD_ENV, REDIS_URL_ENV, REDIS_USERNAME_ENV, Redis, StoreError,
};
use throttlebeam::{IdempotencyOutcome, Runtime};

/// A refusal must come well within this, however busy the machine.
const REFUSED_WITHIN: Duration = Duration::from_secs(5);

fn is_auth(e: &StoreError) -> bool {
    matches!(e, StoreError::Auth(_))
}

/// The error and its causes, for messages.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Idempotency and a throttle work through `redis`.
async fn shares_through(redis: Redis) {
    redis.ping().await.expect("PING over TLS");
    let start = || async {
        Runtime::builder()
            .with_redis(redis.clone())
            .start()
            .await
            .expect("starts")
    };
    // Two instances sharing the node.
    let (rt, other) = (start().await, start().await);
    let runs = Runs::default();
    let run = |value: u64| {
        let runs = runs.clone();
        move || {
            runs.hit();
            std::future::ready(Ok::<_, Oops>(value))
        }
    };
    let idempotency = rt.idempotency();
    assert_eq!(
        idempotency.run("tls:1", run(1)).await.unwrap(),
        IdempotencyOutcome::Fresh(1)
    );
    assert_eq!(
        idempotency.run("tls:1", run(2)).await.unwrap(),
        IdempotencyOutcome::Replay(1)
    );
    assert_eq!(runs.get(), 1);
    let ok = || async { Ok::<_, Oops>(()) };
    let hour = Duration::from_secs(3600);
    let throttle = rt.throttle();
    assert!(
        throttle
            .call("tls:t", hour, ok)
            .await
            .unwrap()
            .is_executed()
    );
    let elsewhere = other.throttle().call("tls:t", hour, ok).await.unwrap();
    assert!(elsewhere.is_throttled());
    assert_eq!(other.stats().throttle.throttled_remotely, 1);
    assert_eq!(
        other.idempotency().run("tls:1", run(3)).await.unwrap(),
        IdempotencyOutcome::Replay(1)
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_node_is_reached_with_its_ca_and_refused_with_another() {
    let Some(node) = TlsNode::start("a_tls_node_is_reached_with_its_ca", false) else {
        return;
    };
    let redis = Redis::builder(node.url())
        .with_ca_pem(node.certs.ca.clone())
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects over TLS: {}", chain(&e)));
    shares_through(redis).await;

    // Another CA, or the system's roots: the server is not trusted.
    for (what, builder) in [
        (
            "another CA",
            Redis::builder(node.url()).with_ca_pem(node.certs.other_ca.clone()),
        ),
        ("the system's roots", Redis::builder(node.url())),
    ] {
        let started = Instant::now();
        let e = builder.connect().await.unwrap_err();
        assert!(is_auth(&e), "{what}: {}", chain(&e));
        assert!(started.elapsed() < REFUSED_WITHIN, "{what}: hung");
        assert!(
            chain(&e).contains("certificate"),
            "{what}: the cause names the certificate: {}",
            chain(&e)
        );
    }

    // A PEM holding no certificate, or certificates for a plain URL.
    let e = Redis::builder(node.url())
        .with_ca_pem("not a certificate")
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Config(m) if m.contains("the CA PEM holds no certificate")),
        "{e}"
    );
    let plain = format!("redis://127.0.0.1:{}", node.server.port);
    let e = Redis::builder(plain)
        .with_ca_pem(node.certs.ca.clone())
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Config(m) if m.contains("no TLS URL")),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_presents_the_client_certificate() {
    let Some(node) = TlsNode::start("mutual_tls_presents_the_client_certificate", true) else {
        return;
    };
    let redis = Redis::builder(node.url())
        .with_ca_pem(node.certs.ca.clone())
        .with_client_cert_pem(
            node.certs.client_cert.clone(),
            node.certs.client_key.clone(),
        )
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects with a client certificate: {}", chain(&e)));
    shares_through(redis).await;

    // Without a client certificate the server refuses the connection.
    let started = Instant::now();
    let e = Redis::builder(node.url())
        .with_ca_pem(node.certs.ca.clone())
        .connect()
        .await
        .unwrap_err();
    assert!(started.elapsed() < REFUSED_WITHIN, "hung: {}", chain(&e));
    assert!(
        is_auth(&e) || matches!(e, StoreError::Unavailable(_)),
        "{}",
        chain(&e)
    );

    // A key that is no key.
    let e = Redis::builder(node.url())
        .with_ca_pem(node.certs.ca.clone())
        .with_client_cert_pem(node.certs.client_cert.clone(), "-----BEGIN NOTHING-----")
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Config(m) if m.contains("the client key")),
        "{e}"
    );
}

/// Set in the process that runs [`from_env_in_a_process_of_its_own`]: what
/// it should find (`ok`, or the text a configuration error holds).
const CHILD: &str = "THROTTLEBEAM_TEST_TLS_EXPECT";

/// `Redis::from_env` reads the URL and the certificate files from the
/// environment; the environment is the process's, so each case runs in a
/// process of its own (this test binary again).
#[test]
fn from_env_reads_the_url_and_the_certificate_files() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(node) = TlsNode::start("from_env_reads_the_url_and_the_certificate_files", true)
    else {
        return;
    };
    let path = |name: &str| node.file(name).to_string_lossy().into_owned();
    let missing = node.file("missing.pem").to_string_lossy().into_owned();
    let cases = [
        ("ok", path("ca.crt"), Some(path("client.key"))),
        (
            "THROTTLEBEAM_REDIS_CA_FILE: cannot read",
            missing,
            Some(path("client.key")),
        ),
        ("go together", path("ca.crt"), None),
        // A password the server (which has none) refuses.
        ("auth", path("ca.crt"), Some(path("client.key"))),
    ];
    for (expect, ca, key) in cases {
        let test = "from_env_in_a_process_of_its_own";
        let mut child = Command::new(std::env::current_exe().unwrap());
        child
            .args(["--exact", test, "--nocapture", "--test-threads", "1"])
            .env(CHILD, expect)
            .env(REDIS_URL_ENV, node.url())
            .env_remove(REDIS_CLUSTER_ENV)
            .env(REDIS_CA_FILE_ENV, ca)
            .env(REDIS_CLIENT_CERT_FILE_ENV, path("client.crt"));
        match key {
            Some(key) => child.env(REDIS_CLIENT_KEY_FILE_ENV, key),
            None => child.env_remove(REDIS_CLIENT_KEY_FILE_ENV),
        };
        child.env_remove(REDIS_USERNAME_ENV);
        match expect {
            "auth" => child.env(REDIS_PASSWORD_ENV, "not this one"),
            _ => child.env_remove(REDIS_PASSWORD_ENV),
        };
        let out = child.output().unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && stdout.contains("from_env found what it should"),
            "{expect}: the child failed or did not run:\n{stdout}\n{stderr}"
        );
    }
}

#[tokio::test]
async fn from_env_in_a_process_of_its_own() {
    let Ok(expect) = std::env::var(CHILD) else {
        // Run by from_env_reads_the_url_and_the_certificate_files.
        return;
    };
    let builder = Redis::from_env().expect("THROTTLEBEAM_REDIS_URL is set");
    let connected = builder.connect().await;
    match (expect.as_str(), connected) {
        ("ok", Ok(redis)) => redis.ping().await.expect("PING"),
        ("ok", Err(e)) => panic!("{}", chain(&e)),
        ("auth", Err(StoreError::Auth(_))) => {}
        (text, Err(StoreError::Config(m))) if m.contains(text) => {}
        (text, other) => panic!("expected a configuration error holding {text:?}: {other:?}"),
    }
    println!("from_env found what it should");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_is_reached_with_its_ca_and_a_client_certificate() {
    let test = "a_tls_cluster_is_reached_with_its_ca_and_a_client_certificate";
    let Some(cluster) = TlsCluster::start(test) else {
        return;
    };
    let certs = &cluster.certs;
    let redis = Redis::builder(cluster.url())
        .with_ca_pem(certs.ca.clone())
        .with_client_cert_pem(certs.client_cert.clone(), certs.client_key.clone())
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects to the TLS cluster: {}", chain(&e)));
    assert!(redis.is_cluster());
    shares_through(redis).await;

    let started = Instant::now();
    let e = Redis::builder(cluster.url())
        .with_ca_pem(certs.other_ca.clone())
        .with_client_cert_pem(certs.client_cert.clone(), certs.client_key.clone())
        .connect()
        .await
        .unwrap_err();
    assert!(started.elapsed() < REFUSED_WITHIN, "hung: {}", chain(&e));
    assert!(is_auth(&e), "{}", chain(&e));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_primary_is_found_through_tls_sentinels() {
    let test = "a_tls_primary_is_found_through_tls_sentinels";
    let Some(mut setup) = SentinelSetup::start_tls(test) else {
        return;
    };
    let certs = setup.certs.as_ref().expect("a TLS setup");
    let redis = Redis::builder(setup.url())
        .with_ca_pem(certs.ca.clone())
        .with_client_cert_pem(certs.client_cert.clone(), certs.client_key.clone())
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects through TLS Sentinels: {}", chain(&e)));
    shares_through(redis.clone()).await;

    // The primary dies: the new one is found and reached over TLS too.
    let wrong_ca = Redis::builder(setup.url())
        .with_ca_pem(certs.other_ca.clone())
        .with_client_cert_pem(certs.client_cert.clone(), certs.client_key.clone());
    setup.primary.kill();
    let killed = Instant::now();
    let bound = Duration::from_secs(30);
    while redis.stats().failovers == 0 || redis.ping().await.is_err() {
        assert!(killed.elapsed() < bound, "not followed within {bound:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(setup.named_primary(), Some(setup.replica.port));

    let started = Instant::now();
    let e = wrong_ca.connect().await.unwrap_err();
    assert!(started.elapsed() < REFUSED_WITHIN, "hung: {}", chain(&e));
    assert!(is_auth(&e), "{}", chain(&e));
}
