//! Deterministic discrete-event simulator that drives `pdkv-core` over modelled NICs, TP
//! collectives and timeouts; the only event queue of the workspace lives here.
//!
//! A run is a pure function of (scenario, seed): events are ordered by (virtual time, sequence
//! number), randomness comes from seeded ChaCha streams, nothing reads a clock or spawns a
//! thread. [`run`] is the entry point.

#![forbid(unsafe_code)]

pub mod calibration;
pub mod catch;
pub mod cost;
pub mod error;
pub mod explore;
pub mod files;
pub mod fit;
pub mod identity;
pub mod load;
pub mod measure;
pub mod model_check;
pub mod nic;
pub mod profiles;
pub mod request_table;
pub mod result;
pub mod rng;
pub mod scenario;
pub mod stack;
pub mod trace;
pub mod unique_keys;
pub mod waitfor;
pub mod world;

pub use error::{PeerError, SimError};
pub use identity::RunIdentity;
pub use result::RunResult;
pub use scenario::{Outcome, Scenario};
pub use world::{Progress, Run, RunOptions};

/// Runs `scenario` to its end; an error names why the scenario cannot run at all.
pub fn run(scenario: &Scenario, options: RunOptions) -> Result<Run, SimError> {
    Ok(world::World::new(scenario, options)?.run())
}

/// [`run`], calling `progress` every few thousand events.
pub fn run_with_progress(
    scenario: &Scenario,
    options: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Run, SimError> {
    Ok(world::World::new(scenario, options)?.run_with_progress(progress))
}
