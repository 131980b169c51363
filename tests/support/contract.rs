//! The idempotency store contract: the same claim / complete / release /
//! renew rules and races, for any store (memory, Redis node and cluster,
//! PostgreSQL).

use std::sync::Arc;
use std::time::Duration;

use throttlebeam::{
    idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
    idempotency::IdempotencyStore, idempotency::StoredResult,
};

pub const LEASE: Duration = Duration::from_secs(30);
pub const TTL: Duration = Duration::from_secs(3600);

pub fn request(
    token: ClaimToken,
    fingerprint: Option<&[u8; 32]>,
    lease: Duration,
) -> ClaimRequest<'_> {
    ClaimRequest::new(token, fingerprint, lease, TTL)
}

fn result(fingerprint: Option<[u8; 32]>, value: u8) -> StoredResult {
    StoredResult::new(fingerprint, "u8", vec![value])
}

/// Whether `store` takes `token`'s completion of `k` with `value`.
async fn completes(
    store: &dyn IdempotencyStore,
    k: &str,
    token: ClaimToken,
    fingerprint: Option<[u8; 32]>,
    value: u8,
) -> bool {
    store
        .complete(k, token, &result(fingerprint, value), TTL)
        .await
        .unwrap()
}

/// Every rule of the contract, on keys under `ns`.
pub async fn contract(store: Arc<dyn IdempotencyStore>, ns: &str) {
    let key = |k: &str| format!("{ns}:{k}");
    let fp = [1u8; 32];
    let other_fp = [2u8; 32];

    // A free key is won; a held one is busy; another fingerprint is a mismatch.
    let (owner, other) = (ClaimToken::new(), ClaimToken::new());
    let k = key("basic");
    let Ok(ClaimReply::Won { fence }) = store.claim(&k, request(owner, Some(&fp), LEASE)).await
    else {
        panic!("a free key is won")
    };
    // I15: the same claim sent again (its reply was lost, a client re-sent it) is still the
    // claimant's, with the same fence: it never waits on itself.
    assert_eq!(
        store
            .claim(&k, request(owner, Some(&fp), LEASE))
            .await
            .unwrap(),
        ClaimReply::Won { fence },
        "a claim re-sent by its own token wins again"
    );
    match store
        .claim(&k, request(other, Some(&fp), LEASE))
        .await
        .unwrap()
    {
        ClaimReply::Busy { lease_left } => {
            assert!(lease_left > LEASE - Duration::from_secs(2) && lease_left <= LEASE);
        }
        reply => panic!("held key: {reply:?}"),
    }
    assert_eq!(
        store
            .claim(&k, request(other, Some(&other_fp), LEASE))
            .await
            .unwrap(),
        ClaimReply::Mismatch
    );
    assert_eq!(
        store.claim(&k, request(other, None, LEASE)).await.unwrap(),
        ClaimReply::Mismatch,
        "no fingerprint is a different fingerprint"
    );
    // Only the owner renews, completes or releases.
    assert!(!store.renew(&k, other, LEASE).await.unwrap());
    assert!(!store.release(&k, other).await.unwrap());
    assert!(
        !store
            .complete(&k, other, &result(Some(fp), 9), TTL)
            .await
            .unwrap()
    );
    assert!(store.renew(&k, owner, LEASE).await.unwrap());
    assert!(
        store
            .complete(&k, owner, &result(Some(fp), 7), TTL)
            .await
            .unwrap()
    );
    // Completed: replayed to anyone with the fingerprint, once and for all.
    assert_eq!(
        store
            .claim(&k, request(other, Some(&fp), LEASE))
            .await
            .unwrap(),
        ClaimReply::Completed(result(Some(fp), 7))
    );
    assert_eq!(
        store
            .claim(&k, request(other, Some(&other_fp), LEASE))
            .await
            .unwrap(),
        ClaimReply::Mismatch
    );
    assert!(
        completes(&*store, &k, owner, Some(fp), 7).await,
        "the same completion retried (its reply lost) is stored, not refused"
    );
    assert!(
        !completes(&*store, &k, other, Some(fp), 7).await,
        "another token never completes a completed key"
    );
    assert!(
        !completes(&*store, &k, owner, Some(fp), 8).await,
        "completes once"
    );
    assert!(
        !store.release(&k, owner).await.unwrap(),
        "a completed key is not released"
    );
    assert!(!store.renew(&k, owner, LEASE).await.unwrap(), "nor renewed");

    // Release frees the key; the next claim gets a larger fence.
    let k = key("release");
    let t1 = ClaimToken::new();
    let Ok(ClaimReply::Won { fence: f1 }) = store.claim(&k, request(t1, None, LEASE)).await else {
        panic!("won")
    };
    assert!(f1 >= 1);
    assert!(store.release(&k, t1).await.unwrap());
    let t2 = ClaimToken::new();
    let Ok(ClaimReply::Won { fence: f2 }) = store.claim(&k, request(t2, None, LEASE)).await else {
        panic!("a released key is won again")
    };
    assert!(f2 > f1, "fences grow: {f1} then {f2}");
    assert!(
        !store.complete(&k, t1, &result(None, 1), TTL).await.unwrap(),
        "the released owner is fenced"
    );
    assert!(store.complete(&k, t2, &result(None, 2), TTL).await.unwrap());

    // Racing claims on a free key: exactly one wins, the rest are busy.
    for round in 0..20 {
        let k = key(&format!("race:{round}"));
        let claims = (0..16).map(|_| {
            let store = Arc::clone(&store);
            let k = k.clone();
            tokio::spawn(async move {
                let token = ClaimToken::new();
                (
                    token,
                    store.claim(&k, request(token, None, LEASE)).await.unwrap(),
                )
            })
        });
        let mut replies = Vec::new();
        for claim in claims {
            replies.push(claim.await.unwrap());
        }
        let winners: Vec<_> = replies
            .iter()
            .filter(|(_, r)| matches!(r, ClaimReply::Won { .. }))
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {replies:?}");
        assert!(
            replies
                .iter()
                .all(|(_, r)| matches!(r, ClaimReply::Won { .. } | ClaimReply::Busy { .. }))
        );
        // Racing completes: only the winner's lands.
        let winner = winners[0].0;
        let completes = replies.iter().map(|(token, _)| {
            let store = Arc::clone(&store);
            let (k, token) = (k.clone(), *token);
            tokio::spawn(async move {
                let value = u8::from(token == winner);
                store
                    .complete(&k, token, &result(None, value), TTL)
                    .await
                    .unwrap()
            })
        });
        let mut landed = 0;
        for complete in completes {
            landed += usize::from(complete.await.unwrap());
        }
        assert_eq!(landed, 1);
        assert_eq!(
            store
                .claim(&k, request(ClaimToken::new(), None, LEASE))
                .await
                .unwrap(),
            ClaimReply::Completed(result(None, 1)),
            "the winner's result is the one stored"
        );
    }

    // A lapsed lease: exactly one of several racing claimants takes over,
    // and the old owner's renew, release and complete are refused.
    let k = key("lapse");
    let old = ClaimToken::new();
    let short = Duration::from_millis(60);
    let Ok(ClaimReply::Won { fence: before }) = store.claim(&k, request(old, None, short)).await
    else {
        panic!("won")
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    let racers: Vec<ClaimToken> = (0..8).map(|_| ClaimToken::new()).collect();
    let mut won = Vec::new();
    for token in &racers {
        if let ClaimReply::Won { fence } =
            store.claim(&k, request(*token, None, LEASE)).await.unwrap()
        {
            assert!(fence > before);
            won.push(*token);
        }
    }
    assert_eq!(won.len(), 1, "one takeover");
    assert!(!store.renew(&k, old, LEASE).await.unwrap());
    assert!(!store.release(&k, old).await.unwrap());
    assert!(
        !store
            .complete(&k, old, &result(None, 0), TTL)
            .await
            .unwrap(),
        "late completion refused"
    );
    assert!(
        store
            .complete(&k, won[0], &result(None, 5), TTL)
            .await
            .unwrap()
    );

    // An owner paused past its lease (I16, the harness's `instance-pause`): its key was taken
    // over, and the taker's run failed, which released the key. The owner's late completion
    // is still refused (the key may run again: its result is not the key's), and the next
    // claim wins with a larger fence.
    let k = key("paused");
    let paused = ClaimToken::new();
    let Ok(ClaimReply::Won { fence: first }) = store.claim(&k, request(paused, None, short)).await
    else {
        panic!("won")
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    let taker = ClaimToken::new();
    let Ok(ClaimReply::Won { fence: second }) = store.claim(&k, request(taker, None, LEASE)).await
    else {
        panic!("the lapsed key is taken over")
    };
    assert!(second > first);
    assert!(store.release(&k, taker).await.unwrap(), "the taker failed");
    assert!(
        !store
            .complete(&k, paused, &result(None, 6), TTL)
            .await
            .unwrap(),
        "a paused owner's late completion after a takeover and a release is refused"
    );
    assert!(!store.renew(&k, paused, LEASE).await.unwrap());
    let next = ClaimToken::new();
    let Ok(ClaimReply::Won { fence: third }) = store.claim(&k, request(next, None, LEASE)).await
    else {
        panic!("a released key is won again, the late completion notwithstanding")
    };
    assert!(third > second);
    assert!(
        store
            .complete(&k, next, &result(None, 7), TTL)
            .await
            .unwrap()
    );

    // Renewing keeps a claim alive past its first lease. The lease is long
    // enough that a renewal sent a third of it late on a busy machine still
    // finds the claim; four renewals take it past the first lease.
    let k = key("renew");
    let holder = ClaimToken::new();
    let renewed = Duration::from_millis(900);
    assert!(matches!(
        store
            .claim(&k, request(holder, None, renewed))
            .await
            .unwrap(),
        ClaimReply::Won { .. }
    ));
    for _ in 0..4 {
        tokio::time::sleep(renewed / 3).await;
        assert!(store.renew(&k, holder, renewed).await.unwrap());
    }
    assert!(matches!(
        store
            .claim(&k, request(ClaimToken::new(), None, LEASE))
            .await
            .unwrap(),
        ClaimReply::Busy { .. }
    ));

    // An owner whose record vanished (lapsed, nobody took over) still stores.
    let k = key("vanished");
    let late = ClaimToken::new();
    assert!(matches!(
        store.claim(&k, request(late, None, short)).await.unwrap(),
        ClaimReply::Won { .. }
    ));
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(
        store
            .complete(&k, late, &result(None, 3), TTL)
            .await
            .unwrap()
    );

    // A completion wakes a watcher registered before it.
    let k = key("watch");
    let holder = ClaimToken::new();
    assert!(matches!(
        store.claim(&k, request(holder, None, LEASE)).await.unwrap(),
        ClaimReply::Won { .. }
    ));
    let changed = store.watch(&k);
    // Give a remote store's subscription time to settle.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        store
            .complete(&k, holder, &result(None, 4), TTL)
            .await
            .unwrap()
    );
    tokio::time::timeout(Duration::from_secs(2), changed)
        .await
        .expect("the watcher wakes on the completion");
}
