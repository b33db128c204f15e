//! Deterministic discrete-event simulator that drives `pdkv-core` over modelled NICs, TP
//! collectives and timeouts (filled in by the simulator issue; the only event queue of the
//! workspace will live here).
