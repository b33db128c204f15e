//! The real driver of `pdkv-core`: control plane over TCP, data plane over RDMA verbs or TCP,
//! memory from HIP or the host (filled in by the backend issue; the only crate allowed `unsafe`).
