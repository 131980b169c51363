//! Run: cargo run --example supervised
//!
//! Embedding: a host application with its own ractor supervision tree starts
//! the throttlebeam runtime linked under its supervisor. A crash inside one
//! key stays inside that key; the runtime's own failure is reported to the
//! host, which restarts it with one call, OTP-style, while handles held
//! elsewhere keep working.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use throttlebeam::{Error, Runtime};
use tokio::sync::Notify;

/// The host's supervisor: logs what its children report and restarts the
/// throttlebeam runtime when its root goes down.
struct HostSupervisor {
    /// The runtime it supervises, set once started.
    runtime: Arc<OnceLock<Runtime>>,
    /// Told after each restart (for the demo's sequencing).
    restarted: Arc<Notify>,
}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for HostSupervisor {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, (): ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match &event {
            SupervisionEvent::ActorStarted(cell) => {
                println!("host: child {} started", cell.get_id());
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                println!("host: child {} failed: {err}", cell.get_id());
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let reason = reason.clone().unwrap_or_default();
                println!("host: child {} stopped ({reason})", cell.get_id());
            }
            _ => {}
        }
        let exited = matches!(
            event,
            SupervisionEvent::ActorFailed(..) | SupervisionEvent::ActorTerminated(..)
        );
        // A graceful shutdown is not a failure: only a runtime that is down
        // is restarted.
        if let (true, Some(runtime)) = (exited, self.runtime.get()) {
            // Back off a little before restarting, as supervisors with a
            // restart delay do.
            if runtime.is_down() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if runtime.is_down() && runtime.restart().await? {
                println!(
                    "host: runtime restarted, new root {}",
                    runtime.root_actor().get_id()
                );
                self.restarted.notify_one();
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Never;

impl std::fmt::Display for Never {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("never")
    }
}

impl std::error::Error for Never {}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Keep the demo's output short: report panics in one line.
    std::panic::set_hook(Box::new(|info| eprintln!("(panic inside a key: {info})")));
    let supervised = Arc::new(OnceLock::new());
    let restarted = Arc::new(Notify::new());
    let host_actor = HostSupervisor {
        runtime: Arc::clone(&supervised),
        restarted: Arc::clone(&restarted),
    };
    let (host, host_done) = Actor::spawn(None, host_actor, ()).await?;
    let runtime = Runtime::builder().start_linked(host.get_cell()).await?;
    let _ = supervised.set(runtime.clone());
    println!("runtime root actor: {}", runtime.root_actor().get_id());

    // A function that panics inside its key: the caller gets an error, the host hears nothing.
    let debounce = runtime.debounce();
    let outcome = debounce
        .call("job:1", Duration::from_millis(10), || async {
            if true {
                panic!("bug in a job");
            }
            Ok::<u32, Never>(0)
        })?
        .await;
    match outcome {
        Err(Error::Panicked { key, message }) => {
            println!("key {key} panicked ({message}); runtime still serving")
        }
        other => println!("unexpected: {other:?}"),
    }

    // The runtime's root itself goes down (killed here to show it): calls
    // fail fast until the host restarts it, then the same handle works again.
    let throttle = runtime.throttle();
    runtime.root_actor().kill();
    // The host backs off for 100 ms before restarting it: this call lands
    // while it is down.
    tokio::time::sleep(Duration::from_millis(10)).await;
    match throttle
        .call("job:2", Duration::from_secs(1), || async {
            Ok::<_, Never>(2)
        })
        .await
    {
        Err(e @ Error::RuntimeDown { .. }) => println!("while down: {e}"),
        other => println!("(this call did not land while it was down: {other:?})"),
    }
    restarted.notified().await;
    let ok = throttle
        .call("job:2", Duration::from_secs(1), || async {
            Ok::<_, Never>(2)
        })
        .await?;
    println!("after the restart, key job:2 ran: {ok:?}");
    println!("stats: {:?}", runtime.stats());

    let report = runtime.shutdown(Duration::from_secs(1)).await;
    println!(
        "runtime shut down, {} function(s) still running",
        report.still_running
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    host.stop(None);
    host_done.await?;
    Ok(())
}
