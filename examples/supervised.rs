//! Run: cargo run --example supervised
//!
//! Embedding: a host application with its own ractor supervision tree starts
//! the throttlebeam runtime linked under its supervisor. A crash inside one
//! key stays inside that key; the runtime's own exit is reported to the host.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use throttlebeam::{Error, Runtime};

/// The host's supervisor: logs what its children report.
struct HostSupervisor;

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
        match event {
            SupervisionEvent::ActorStarted(cell) => {
                println!("host: child {} started", cell.get_id())
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                println!(
                    "host: child {} failed: {err}; a real host would restart it",
                    cell.get_id()
                );
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                println!(
                    "host: child {} stopped ({})",
                    cell.get_id(),
                    reason.unwrap_or_default()
                );
            }
            _ => {}
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
    let (host, host_done) = Actor::spawn(None, HostSupervisor, ()).await?;
    let runtime = Runtime::builder().start_linked(host.get_cell()).await?;
    println!("runtime root actor: {}", runtime.root_actor().get_id());

    // A function that panics inside its key: the caller gets an error, the host hears nothing.
    let outcome = runtime
        .debounce()
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
    let ok = runtime
        .debounce()
        .call("job:2", Duration::from_millis(10), || async {
            Ok::<_, Never>(2)
        })?
        .await?;
    println!("key job:2 ran and returned {ok}");

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
