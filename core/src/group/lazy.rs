//! Legacy only: the decode group under the lazy handshake ([`HandshakeMode::Lazy`], from
//! `lazy-handshake`). There is no vote: each worker reports ready once its own blocking
//! handshakes are done, whatever its peers do, and a worker whose handshake fails raises alone.
//! The group still counts who entered the forward, so a step with a raised member never reaches
//! it: the divergence the barrier of the fixed protocol exists to prevent. The fixed barrier asks
//! these rules when a vote or a report arrives.

use crate::ids::TpRank;
#[cfg(doc)]
use crate::policy::HandshakeMode;

use super::{DecodeGroup, Ignored, StepReport};

impl DecodeGroup {
    /// Lazy: a vote from a live member on the current step is never counted (there is none to
    /// count it in); any other vote is ignored for the reason it would be under the fixed
    /// protocol.
    pub(super) fn lazy_vote(&mut self, member: TpRank, step: u64) -> Result<(), Ignored> {
        self.round_for(member, step)?;
        Err(Ignored::NoVote { member, step })
    }

    /// Lazy: whether a worker's report stands. Ready stands without a decision (nobody decides)
    /// and so does a raise; failing with the group does not, since no group decided anything.
    pub(super) fn lazy_report_stands(report: StepReport) -> bool {
        match report {
            StepReport::Ready | StepReport::Raised => true,
            StepReport::FailedWithGroup => false,
        }
    }
}
