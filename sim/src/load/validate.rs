//! The rules of the scenario format that serde cannot express ([`validate`]), each broken rule
//! a [`Violation`] naming its dotted field. `docs/scenarios.md` lists the rules.

use std::fmt;

use pdkv_core::ids::Role;
use pdkv_core::routing::check_pair;
use pdkv_core::topology::{Deployment, Layout};

use pdkv_engine::target::parse_target;
use pdkv_engine::timeouts::ProtocolTimeouts;

use super::target::check_target;
use crate::cost::Cost;
use crate::scenario::{
    Clients, FaultKind, JainBounds, Length, Scenario, MAX_CONCURRENCY, MAX_ENGINE_CRASHES, MAX_EVENTS,
    MAX_KV_BYTES_PER_GPU, MAX_MODEL_DIMENSION, MAX_REQUESTS, MAX_TIMELINE_FAULTS, MAX_TIME_MS, MAX_TIME_US,
    MAX_TOKENS, MAX_TOTAL_KV_BLOCKS, MAX_VIRTUAL_TIME_S, MIN_SLOW_NIC_FACTOR, RATE_RANGE,
};

/// A rule of the scenario format that a parsed scenario breaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Dotted path of the offending field, e.g. `faults.timeline[0].target`.
    pub field: String,
    /// The rule and the value found.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field `{}`: {}", self.field, self.message)
    }
}

pub(super) fn violation(field: impl Into<String>, message: impl Into<String>) -> Violation {
    Violation { field: field.into(), message: message.into() }
}

/// A check of one field: `Ok` or the violation naming it.
pub(super) type Check = Result<(), Violation>;

fn at_least_one(field: &str, value: u64) -> Check {
    if value >= 1 {
        Ok(())
    } else {
        Err(violation(field, "must be at least 1, got 0"))
    }
}

/// `value` is at most `max` (a named limit of `scenario.rs`); `unit` follows the numbers.
fn at_most(field: &str, value: u64, max: u64, unit: &str) -> Check {
    if value <= max {
        Ok(())
    } else {
        Err(violation(field, format!("must be at most {max}{unit}, got {value}")))
    }
}

/// `value` of `field` is at most `bound`, the value of `bound_field`.
fn within<T: PartialOrd + fmt::Display>(field: &str, value: T, bound_field: &str, bound: T) -> Check {
    if value <= bound {
        Ok(())
    } else {
        Err(violation(field, format!("must be at most {bound_field} ({bound}), got {value}")))
    }
}

/// A time in milliseconds: at least 1 ms and at most [`MAX_TIME_MS`], so its conversion to
/// nanoseconds, and sums of such times, cannot overflow.
fn time_ms(field: &str, value: u64) -> Check {
    at_least_one(field, value)?;
    at_most(field, value, MAX_TIME_MS, " ms (about 115 days)")
}

/// A bandwidth, throughput or rate: positive, finite and within [`RATE_RANGE`].
fn positive(field: &str, value: f64) -> Check {
    let (lo, hi) = RATE_RANGE;
    if !(value.is_finite() && value > 0.0) {
        return Err(violation(field, format!("must be a positive finite number, got {value}")));
    }
    if !(lo..=hi).contains(&value) {
        return Err(violation(field, format!("must be between {lo:e} and {hi:e}, got {value:e}")));
    }
    Ok(())
}

/// A duration given as a float in the field's unit: finite, at least 0 and at most `max`.
fn non_negative(field: &str, value: f64, max: f64) -> Check {
    if !(value.is_finite() && value >= 0.0) {
        return Err(violation(field, format!("must be a finite number of at least 0, got {value}")));
    }
    if value > max {
        return Err(violation(field, format!("must be at most {max:e} (about 115 days), got {value:e}")));
    }
    Ok(())
}

/// A fraction in (0, 1]; `NaN` fails both comparisons and is rejected too.
fn fraction(field: &str, value: f64) -> Check {
    if value > 0.0 && value <= 1.0 {
        Ok(())
    } else {
        Err(violation(field, format!("must be a fraction in (0, 1] (above 0, at most 1), got {value}")))
    }
}

fn probability(field: &str, value: f64) -> Check {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(violation(field, format!("must be a probability in [0, 1], got {value}")))
    }
}

/// Checks the rules serde cannot express; the first violation found is returned (fields are
/// checked in file order, except that engine pairs are checked after `model`, which they need).
/// `docs/scenarios.md` lists the rules.
pub fn validate(scenario: &Scenario) -> Result<(), Violation> {
    validate_name(&scenario.name)?;
    let deployment =
        Deployment::parse(&scenario.deployment).map_err(|err| violation("deployment", err.to_string()))?;
    validate_model(scenario)?;
    let spec = scenario.model_spec();
    for (d, decode) in deployment.decode.iter().enumerate() {
        for (p, prefill) in deployment.prefill.iter().enumerate() {
            check_pair(*decode, *prefill, &spec).map_err(|err| {
                violation(
                    "deployment",
                    format!(
                        "decode engine D{d} ({decode}) cannot read prefill engine P{p} ({prefill}): {err}"
                    ),
                )
            })?;
        }
    }
    validate_hardware_and_cost(scenario)?;
    validate_workload(scenario)?;
    validate_protocol(scenario)?;
    validate_peers(scenario, &deployment)?;
    let engines = &scenario.engines;
    at_least_one("engines.prefill_max_batched_tokens", engines.prefill_max_batched_tokens.into())?;
    at_least_one("engines.decode_max_batch", engines.decode_max_batch.into())?;
    if crate::stack::find(&engines.stack).is_none() {
        let known = crate::stack::names().join(", ");
        return Err(violation(
            "engines.stack",
            format!("must name a serving stack ({known}), got {:?}", engines.stack),
        ));
    }
    if engines.prefill_register_delay_ms > 0 {
        time_ms("engines.prefill_register_delay_ms", engines.prefill_register_delay_ms)?;
    }
    validate_pools(scenario, &deployment)?;
    validate_faults(scenario, &deployment)?;
    let limits = &scenario.limits;
    at_least_one("limits.max_virtual_time_s", limits.max_virtual_time_s)?;
    at_most("limits.max_virtual_time_s", limits.max_virtual_time_s, MAX_VIRTUAL_TIME_S, " s (one day)")?;
    at_least_one("limits.max_events", limits.max_events)?;
    at_most("limits.max_events", limits.max_events, MAX_EVENTS, "")?;
    validate_measure(scenario)?;
    if let Some(bounds) = scenario.expect_jain {
        validate_jain(bounds)?;
    }
    Ok(())
}

/// A warm-up is at most the largest run, and a whole run has none; an SLO gives at least one
/// target, each a positive time of at most [`MAX_TIME_MS`].
fn validate_measure(scenario: &Scenario) -> Check {
    let measure = &scenario.measure;
    if let Some(warmup) = measure.warmup_requests {
        at_most("measure.warmup_requests", warmup.into(), MAX_REQUESTS.into(), " requests")?;
        if measure.whole_run {
            return Err(violation(
                "measure.warmup_requests",
                "cannot be given with measure.whole_run: true (a whole run has no warm-up)",
            ));
        }
    }
    let Some(slo) = scenario.slo else { return Ok(()) };
    if slo.ttft_ms.is_none() && slo.tpot_ms.is_none() {
        return Err(violation("slo", "must give ttft_ms, tpot_ms or both"));
    }
    for (field, target) in [("slo.ttft_ms", slo.ttft_ms), ("slo.tpot_ms", slo.tpot_ms)] {
        if let Some(ms) = target {
            if !(ms.is_finite() && ms > 0.0 && ms <= MAX_TIME_MS as f64) {
                return Err(violation(
                    field,
                    format!("must be a time above 0 and at most {MAX_TIME_MS} ms (about 115 days), got {ms}"),
                ));
            }
        }
    }
    Ok(())
}

/// The Jain index lies in (0, 1]; bounds outside [0, 1], `NaN`, or a lower bound above the
/// upper one could never hold, or always would, which is a mistake in the file.
fn validate_jain(bounds: JainBounds) -> Check {
    for (field, value) in [("expect_jain.at_least", bounds.at_least), ("expect_jain.at_most", bounds.at_most)]
    {
        if let Some(value) = value {
            if !(0.0..=1.0).contains(&value) {
                return Err(violation(
                    field,
                    format!("must be a number in [0, 1] (a Jain index), got {value}"),
                ));
            }
        }
    }
    if let (Some(lo), Some(hi)) = (bounds.at_least, bounds.at_most) {
        if lo > hi {
            return Err(violation(
                "expect_jain.at_most",
                format!("must be at least expect_jain.at_least ({lo}), got {hi}"),
            ));
        }
    }
    Ok(())
}

/// The largest value a length can take.
fn longest(length: Length) -> u32 {
    match length {
        Length::Fixed(n) => n,
        Length::Uniform { max, .. } => max,
    }
}

/// Every pool fits the simulated address space, and the longest request fits every pool it can
/// be routed to: a prompt larger than a prefill DP rank's pool would stall that rank forever, and
/// a request larger than a decode pool would wait forever for admission, both of which would be
/// reported as a protocol hang.
fn validate_pools(scenario: &Scenario, deployment: &Deployment) -> Check {
    let cost = Cost::of(scenario);
    let explicit = scenario.engines.kv_blocks_per_gpu;
    let fixed = scenario.hardware.kv_memory_fraction > 0.0;
    let (pool_field, pool_source) = match (explicit > 0, fixed) {
        (true, _) => ("engines.kv_blocks_per_gpu", "engines.kv_blocks_per_gpu"),
        (false, true) => ("hardware.hbm_gb", "hardware.hbm_gb x hardware.kv_memory_fraction"),
        (false, false) => (
            "hardware.hbm_gb",
            "hardware.hbm_gb x engines.gpu_memory_utilization, less the weights and cost.activation_reserve_gb",
        ),
    };
    // The KV cache is what the weights leave; a layout whose weights do not fit has none.
    crate::cost::kv_room(scenario, deployment)
        .map_err(|err| violation("hardware.hbm_gb", err.to_string()))?;
    let blocks_for = |layout: Layout| if explicit > 0 { explicit } else { cost.kv_blocks_per_gpu(layout) };
    let block = u64::from(scenario.model.block_size_tokens);
    let input_blocks = u64::from(longest(scenario.workload.input_tokens)).div_ceil(block);
    let output_blocks = u64::from(longest(scenario.workload.output_tokens)).div_ceil(block);
    let layers = u64::from(scenario.model.layers);
    let total: u64 = [Role::Prefill, Role::Decode]
        .iter()
        .flat_map(|&role| deployment.engines(role).iter())
        .map(|layout| u64::from(layout.dp) * u64::from(blocks_for(*layout)))
        .sum();
    if total > MAX_TOTAL_KV_BLOCKS {
        return Err(violation(
            pool_field,
            format!(
                "the deployment's pools hold {total} KV blocks in all; at most {MAX_TOTAL_KV_BLOCKS} \
                 are simulated (make {pool_field} smaller)"
            ),
        ));
    }
    for role in [Role::Prefill, Role::Decode] {
        for (e, layout) in deployment.engines(role).iter().enumerate() {
            let letter = role.letter();
            let blocks = u64::from(blocks_for(*layout));
            let bytes = blocks.saturating_mul(cost.block_bytes_per_layer(layout.tp)).saturating_mul(layers);
            if bytes > MAX_KV_BYTES_PER_GPU {
                return Err(violation(
                    pool_field,
                    format!(
                        "engine {letter}{e} ({layout}) would register {bytes} bytes of KV per GPU \
                         ({blocks} blocks); at most {MAX_KV_BYTES_PER_GPU} (256 GiB) fit the simulated \
                         address space"
                    ),
                ));
            }
            let (needed, field, what) = match role {
                Role::Prefill => (input_blocks, "workload.input_tokens", "the longest prompt"),
                Role::Decode => (
                    input_blocks + output_blocks,
                    "workload.output_tokens",
                    "the longest prompt plus the longest output",
                ),
            };
            if needed > blocks {
                return Err(violation(
                    field,
                    format!(
                        "{what} needs {needed} KV blocks of {block} tokens, but a DP rank of engine \
                         {letter}{e} ({layout}) holds only {blocks} ({pool_source}): such a request \
                         could never be served"
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn validate_name(name: &str) -> Check {
    // The name becomes an output folder name, so it must be one plain path component.
    if name.is_empty() || name == "." || name == ".." {
        return Err(violation("name", format!("must be a folder name, got `{}`", name.escape_debug())));
    }
    if let Some(bad) = name.chars().find(|&c| c == '/' || c == '\\' || c.is_control()) {
        return Err(violation(
            "name",
            format!("must be a folder name, without `{}`; got `{}`", bad.escape_debug(), name.escape_debug()),
        ));
    }
    Ok(())
}

fn validate_model(scenario: &Scenario) -> Check {
    let model = &scenario.model;
    at_least_one("model.kv_heads", model.kv_heads.into())?;
    if model.use_mla && model.kv_heads != 1 {
        return Err(violation(
            "model.kv_heads",
            format!("must be 1 when model.use_mla is true (one latent per token), got {}", model.kv_heads),
        ));
    }
    at_least_one("model.layers", model.layers.into())?;
    if model.moe_layers > model.layers {
        return Err(violation(
            "model.moe_layers",
            format!("must be at most model.layers ({}), got {}", model.layers, model.moe_layers),
        ));
    }
    let dimension = u64::from(MAX_MODEL_DIMENSION);
    at_least_one("model.kv_bytes_per_token_per_layer", model.kv_bytes_per_token_per_layer.into())?;
    at_most("model.kv_bytes_per_token_per_layer", model.kv_bytes_per_token_per_layer.into(), dimension, "")?;
    at_least_one("model.block_size_tokens", model.block_size_tokens.into())?;
    at_most("model.block_size_tokens", model.block_size_tokens.into(), dimension, "")?;
    positive("model.active_params_b", model.active_params_b)?;
    at_least_one("model.hidden_size", model.hidden_size.into())?;
    at_most("model.hidden_size", model.hidden_size.into(), dimension, "")?;
    // The fields added with the profiles: their ranges, and the two orderings no model can
    // break. The rules between them (KV bytes from heads, dense models
    // without experts) are the profiles' (`crate::profiles`), since a hand-written model block
    // that sets only what the cost model reads leaves the others at DeepSeek-R1's values.
    at_least_one("model.head_dim", model.head_dim.into())?;
    at_most("model.head_dim", model.head_dim.into(), dimension, "")?;
    positive("model.total_params_b", model.total_params_b)?;
    within("model.active_params_b", model.active_params_b, "model.total_params_b", model.total_params_b)?;
    within("model.experts_per_token", model.experts_per_token, "model.routed_experts", model.routed_experts)?;
    // 0 for a dense model, else a count of millions like the other rates.
    if model.expert_params_per_layer_m != 0.0 {
        positive("model.expert_params_per_layer_m", model.expert_params_per_layer_m)?;
    }
    positive("model.weight_bytes_per_param", model.weight_bytes_per_param)?;
    at_least_one("model.attention_heads", model.attention_heads.into())
}

fn validate_hardware_and_cost(scenario: &Scenario) -> Check {
    let hw = &scenario.hardware;
    positive("hardware.hbm_gb", hw.hbm_gb)?;
    if hw.kv_memory_fraction != 0.0 {
        fraction("hardware.kv_memory_fraction", hw.kv_memory_fraction)?;
    }
    fraction("engines.gpu_memory_utilization", scenario.engines.gpu_memory_utilization)?;
    positive("hardware.hbm_tb_s", hw.hbm_tb_s)?;
    positive("hardware.fp8_tflops", hw.fp8_tflops)?;
    positive("hardware.fabric_gb_s", hw.fabric_gb_s)?;
    positive("hardware.nic_gb_s", hw.nic_gb_s)?;
    non_negative("hardware.nic_latency_us", hw.nic_latency_us, MAX_TIME_US)?;
    non_negative("hardware.control_latency_us", hw.control_latency_us, MAX_TIME_US)?;
    non_negative("hardware.listener_service_us", hw.listener_service_us, MAX_TIME_US)?;
    positive("hardware.bf16_tflops", hw.bf16_tflops)?;
    at_least_one("hardware.gpus_per_node", hw.gpus_per_node.into())?;
    positive("hardware.line_rate_gbit", hw.line_rate_gbit)?;
    positive("hardware.nic_message_rate_mpps", hw.nic_message_rate_mpps)?;
    at_least_one("hardware.nic_qps", hw.nic_qps.into())?;
    positive("hardware.nic_qp_message_rate_mpps", hw.nic_qp_message_rate_mpps)?;
    let cost = &scenario.cost;
    let max_ms = MAX_TIME_MS as f64;
    non_negative("cost.prefill_fixed_ms", cost.prefill_fixed_ms, max_ms)?;
    fraction("cost.prefill_mfu", cost.prefill_mfu)?;
    non_negative("cost.decode_fixed_ms", cost.decode_fixed_ms, max_ms)?;
    fraction("cost.decode_weight_efficiency", cost.decode_weight_efficiency)?;
    fraction("cost.decode_mfu", cost.decode_mfu)?;
    non_negative("cost.alltoall_latency_us", cost.alltoall_latency_us, MAX_TIME_US)?;
    fraction("cost.decode_kv_efficiency", cost.decode_kv_efficiency)?;
    non_negative("cost.decode_per_request_us", cost.decode_per_request_us, MAX_TIME_US)?;
    fraction("cost.fabric_efficiency", cost.fabric_efficiency)?;
    let reserve = cost.activation_reserve_gb;
    if !(reserve.is_finite() && reserve >= 0.0) {
        return Err(violation(
            "cost.activation_reserve_gb",
            format!("must be a finite number of at least 0, got {reserve}"),
        ));
    }
    Ok(())
}

fn validate_length(field: &str, length: Length) -> Check {
    match length {
        Length::Fixed(tokens) => {
            at_least_one(field, tokens.into())?;
            at_most(field, tokens.into(), MAX_TOKENS.into(), " tokens")
        }
        Length::Uniform { min, max } => {
            at_least_one(&format!("{field}.min"), min.into())?;
            at_most(&format!("{field}.max"), max.into(), MAX_TOKENS.into(), " tokens")?;
            if min > max {
                return Err(violation(field, format!("Uniform min {min} is greater than max {max}")));
            }
            Ok(())
        }
    }
}

fn validate_workload(scenario: &Scenario) -> Check {
    let workload = &scenario.workload;
    match workload.clients {
        Clients::Closed { concurrency, requests } => {
            at_least_one("workload.clients.concurrency", concurrency.into())?;
            at_most("workload.clients.concurrency", concurrency.into(), MAX_CONCURRENCY.into(), "")?;
            at_least_one("workload.clients.requests", requests.into())?;
            at_most("workload.clients.requests", requests.into(), MAX_REQUESTS.into(), "")?;
        }
        Clients::Open { rate_per_s, requests } => {
            positive("workload.clients.rate_per_s", rate_per_s)?;
            at_least_one("workload.clients.requests", requests.into())?;
            at_most("workload.clients.requests", requests.into(), MAX_REQUESTS.into(), "")?;
        }
    }
    validate_length("workload.input_tokens", workload.input_tokens)?;
    validate_length("workload.output_tokens", workload.output_tokens)
}

fn validate_protocol(scenario: &Scenario) -> Check {
    let protocol = &scenario.protocol;
    for (i, option) in protocol.legacy.iter().enumerate() {
        if protocol.legacy[..i].contains(option) {
            return Err(violation(format!("protocol.legacy[{i}]"), format!("`{option}` is listed twice")));
        }
    }
    // The engine layer's limits, which the cluster's flags share; each names its field here.
    for (timeout, ms) in protocol.timeouts().each() {
        if !ProtocolTimeouts::within_limits(ms) {
            time_ms(&format!("protocol.{}_timeout_ms", timeout.name()), ms)?;
        }
    }
    Ok(())
}

/// Every key of `protocol.peers` is an engine of the deployment and every value a rule set; the
/// violation names the entry (`protocol.peers["P3"]`).
fn validate_peers(scenario: &Scenario, deployment: &Deployment) -> Check {
    match scenario.peer_book(deployment) {
        Ok(_) => Ok(()),
        Err(error) => Err(violation(format!("protocol.peers[\"{}\"]", error.key()), error.to_string())),
    }
}

fn validate_faults(scenario: &Scenario, deployment: &Deployment) -> Check {
    let timeline = &scenario.faults.timeline;
    if timeline.len() > MAX_TIMELINE_FAULTS {
        return Err(violation(
            "faults.timeline",
            format!("holds at most {MAX_TIMELINE_FAULTS} faults, got {}", timeline.len()),
        ));
    }
    let mut crashes = 0;
    for (i, timed) in timeline.iter().enumerate() {
        let field = format!("faults.timeline[{i}]");
        at_most(&format!("{field}.at_ms"), timed.at_ms, MAX_TIME_MS, " ms (about 115 days)")?;
        check_target(&timed.target.0, deployment).map_err(|why| violation(format!("{field}.target"), why))?;
        match timed.fault {
            FaultKind::DelayMessages { delay_ms } => time_ms(&format!("{field}.fault.delay_ms"), delay_ms)?,
            FaultKind::SlowListener { service_ms } => {
                time_ms(&format!("{field}.fault.service_ms"), service_ms)?
            }
            FaultKind::SlowNic { factor } => {
                let field = format!("{field}.fault.factor");
                fraction(&field, factor)?;
                if factor < MIN_SLOW_NIC_FACTOR {
                    return Err(violation(
                        field,
                        format!("must be at least {MIN_SLOW_NIC_FACTOR:e} (a millionth), got {factor:e}"),
                    ));
                }
            }
            FaultKind::EngineCrash => {
                crashes += 1;
                if crashes > MAX_ENGINE_CRASHES {
                    return Err(violation(
                        format!("{field}.fault"),
                        format!("at most {MAX_ENGINE_CRASHES} EngineCrash faults fit one timeline"),
                    ));
                }
            }
            FaultKind::LoseMessages
            | FaultKind::DuplicateMessages
            | FaultKind::DeadListener
            | FaultKind::NicDown
            | FaultKind::SendQueueFull => {}
        }
        if matches!(timed.fault, FaultKind::SendQueueFull)
            && parse_target(&timed.target.0).is_some_and(|p| p.role == Role::Prefill)
        {
            return Err(violation(
                format!("{field}.target"),
                "SendQueueFull applies to decode ranks (they post the reads), e.g. D0.dp*.tp*",
            ));
        }
        if let Some(duration) = timed.duration_ms {
            time_ms(&format!("{field}.duration_ms"), duration)?;
        }
        if let Some(count) = timed.count {
            let message_fault = matches!(
                timed.fault,
                FaultKind::LoseMessages | FaultKind::DelayMessages { .. } | FaultKind::DuplicateMessages
            );
            if !message_fault {
                return Err(violation(
                    format!("{field}.count"),
                    "applies only to message faults (LoseMessages, DelayMessages, DuplicateMessages)",
                ));
            }
            at_least_one(&format!("{field}.count"), count.into())?;
        }
    }
    let swarm = &scenario.faults.swarm;
    probability("faults.swarm.loss", swarm.loss)?;
    probability("faults.swarm.duplicate", swarm.duplicate)?;
    probability("faults.swarm.delay", swarm.delay)?;
    probability("faults.swarm.send_queue_full", swarm.send_queue_full)?;
    if swarm.delay > 0.0 && swarm.max_delay_ms == 0 {
        return Err(violation(
            "faults.swarm.max_delay_ms",
            "must be at least 1 when faults.swarm.delay is above 0",
        ));
    }
    at_most("faults.swarm.max_delay_ms", swarm.max_delay_ms, MAX_TIME_MS, " ms (about 115 days)")?;
    match scenario.faults.transfer_timeout_ms {
        Some(ms) if !ProtocolTimeouts::within_limits(ms) => time_ms("faults.transfer_timeout_ms", ms),
        Some(_) => Ok(()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{check_err, fault, with, Kind};

    #[test]
    fn load_validation_rules_name_the_field() {
        use Kind::Invalid;
        let ok = "(name: \"x\", deployment: \"1P_TP8:1D_TP8\")";
        let table: Vec<(String, (Kind, &str, &str))> = vec![
            (ok.replace("\"x\"", "\"a/b\""), (Invalid, "name", "without `/`; got `a/b`")),
            (ok.replace("\"x\"", "\"..\""), (Invalid, "name", "folder name")),
            (ok.replace("8:1", "8-1"), (Invalid, "deployment", "':' between")),
            (
                ok.replace("1D_TP8", "1D_TP8+1D_TP3"),
                (Invalid, "deployment", "decode engine D1 (TP3) cannot read prefill engine P0 (TP8)"),
            ),
            (with("model: (kv_heads: 0)"), (Invalid, "model.kv_heads", "at least 1")),
            (with("model: (kv_heads: 2)"), (Invalid, "model.kv_heads", "must be 1 when model.use_mla")),
            (with("model: (layers: 0)"), (Invalid, "model.layers", "at least 1")),
            (with("model: (layers: 10, moe_layers: 11)"), (Invalid, "model.moe_layers", "at most")),
            (
                with("model: (kv_bytes_per_token_per_layer: 0)"),
                (Invalid, "model.kv_bytes_per_token_per_layer", "at least 1"),
            ),
            (with("model: (block_size_tokens: 0)"), (Invalid, "model.block_size_tokens", "at least 1")),
            (with("model: (active_params_b: 0.0)"), (Invalid, "model.active_params_b", "positive")),
            (with("model: (hidden_size: 0)"), (Invalid, "model.hidden_size", "at least 1")),
            (with("model: (head_dim: 0)"), (Invalid, "model.head_dim", "at least 1")),
            (with("model: (total_params_b: 30.0)"), (Invalid, "model.active_params_b", "at most model.total_params_b (30)")),
            (with("model: (experts_per_token: 300)"), (Invalid, "model.experts_per_token", "at most model.routed_experts (256)")),
            (with("model: (expert_params_per_layer_m: -1)"), (Invalid, "model.expert_params_per_layer_m", "positive")),
            (with("model: (weight_bytes_per_param: 0)"), (Invalid, "model.weight_bytes_per_param", "positive")),
            (with("model: (attention_heads: 0)"), (Invalid, "model.attention_heads", "at least 1")),
            (
                with("faults: (timeline: [(at_ms: 0, target: \"P0.dp0.tp0\", fault: SendQueueFull)])"),
                (Invalid, "faults.timeline[0].target", "applies to decode ranks"),
            ),
            (with("hardware: (hbm_gb: 0)"), (Invalid, "hardware.hbm_gb", "positive")),
            (with("hardware: (kv_memory_fraction: 1.5)"), (Invalid, "hardware.kv_memory_fraction", "(0, 1]")),
            (with("hardware: (kv_memory_fraction: -0.5)"), (Invalid, "hardware.kv_memory_fraction", "(0, 1]")),
            (with("engines: (gpu_memory_utilization: 0)"), (Invalid, "engines.gpu_memory_utilization", "(0, 1]")),
            (with("engines: (stack: \"trt-llm\")"), (Invalid, "engines.stack", "(vllm, sglang, deepseek), got \"trt-llm\"")),
            (with("cost: (activation_reserve_gb: NaN)"), (Invalid, "cost.activation_reserve_gb", "got NaN")),
            // DeepSeek-R1's weights (671 GB at one byte) do not fit four 192 GB GPUs with room for KV.
            (
                with("description: \"y\"").replace("1P_TP8:", "1P_TP4:"),
                (Invalid, "hardware.hbm_gb", "engine P0 (TP4) leaves -1.1 GB of KV cache per GPU (under 1 GB): the model's weights take 167.8 GB"),
            ),
            (
                with("cost: (activation_reserve_gb: 100)"),
                (Invalid, "hardware.hbm_gb", "out of 176.6 GB usable (192 GB x engines.gpu_memory_utilization 0.92)"),
            ),
            (with("hardware: (nic_gb_s: inf)"), (Invalid, "hardware.nic_gb_s", "finite")),
            (with("hardware: (nic_gb_s: NaN)"), (Invalid, "hardware.nic_gb_s", "got NaN")),
            (with("hardware: (nic_latency_us: -1)"), (Invalid, "hardware.nic_latency_us", "at least 0")),
            (with("hardware: (bf16_tflops: 0)"), (Invalid, "hardware.bf16_tflops", "positive")),
            (with("hardware: (gpus_per_node: 0)"), (Invalid, "hardware.gpus_per_node", "at least 1")),
            (with("hardware: (line_rate_gbit: -400)"), (Invalid, "hardware.line_rate_gbit", "positive")),
            (with("hardware: (nic_message_rate_mpps: 0)"), (Invalid, "hardware.nic_message_rate_mpps", "positive")),
            (with("hardware: (nic_qps: 0)"), (Invalid, "hardware.nic_qps", "at least 1")),
            (
                with("hardware: (nic_qp_message_rate_mpps: -1)"),
                (Invalid, "hardware.nic_qp_message_rate_mpps", "positive"),
            ),
            (with("cost: (prefill_mfu: 0.0)"), (Invalid, "cost.prefill_mfu", "(0, 1]")),
            (with("cost: (fabric_efficiency: 1.01)"), (Invalid, "cost.fabric_efficiency", "got 1.01")),
            (with("cost: (decode_fixed_ms: -3)"), (Invalid, "cost.decode_fixed_ms", "got -3")),
            (
                with("workload: (clients: Closed(concurrency: 4, requests: 0))"),
                (Invalid, "workload.clients.requests", "at least 1"),
            ),
            (
                with("workload: (clients: Open(rate_per_s: 0.0, requests: 5))"),
                (Invalid, "workload.clients.rate_per_s", "positive"),
            ),
            (with("workload: (output_tokens: Fixed(0))"), (Invalid, "workload.output_tokens", "at least 1")),
            (
                with("workload: (input_tokens: Uniform(min: 0, max: 5))"),
                (Invalid, "workload.input_tokens.min", "at least 1"),
            ),
            (
                with("protocol: (handshake_timeout_ms: 0)"),
                (Invalid, "protocol.handshake_timeout_ms", "at least 1"),
            ),
            (
                with("protocol: (collective_timeout_ms: 0)"),
                (Invalid, "protocol.collective_timeout_ms", "at least 1"),
            ),
            (
                with("protocol: (legacy: [\"dedup-releases\", r#dedup-releases])"),
                (Invalid, "protocol.legacy[1]", "`dedup-releases` is listed twice"),
            ),
            (with("engines: (decode_max_batch: 0)"), (Invalid, "engines.decode_max_batch", "at least 1")),
            (with("limits: (max_events: 0)"), (Invalid, "limits.max_events", "at least 1")),
            (with("limits: (max_virtual_time_s: 0)"), (Invalid, "limits.max_virtual_time_s", "at least 1")),
            (
                fault("D0.dp0.tp0", "NicDown, duration_ms: 0"),
                (Invalid, "faults.timeline[0].duration_ms", "at least 1"),
            ),
            (
                fault("D0.dp0.tp0", "NicDown, count: 3"),
                (Invalid, "faults.timeline[0].count", "only to message faults"),
            ),
            (
                fault("D0.dp0.tp0", "LoseMessages, count: 0"),
                (Invalid, "faults.timeline[0].count", "at least 1"),
            ),
            (
                fault("D*.dp*.tp*", "DelayMessages(delay_ms: 0)"),
                (Invalid, "faults.timeline[0].fault.delay_ms", "at least 1"),
            ),
            (
                fault("P0.dp0.tp0", "SlowListener(service_ms: 0)"),
                (Invalid, "faults.timeline[0].fault.service_ms", "at least 1"),
            ),
            (
                fault("P0.dp0.tp0", "SlowNic(factor: 0.0)"),
                (Invalid, "faults.timeline[0].fault.factor", "(0, 1]"),
            ),
            (
                fault("D1.dp0.tp0", "NicDown"),
                (Invalid, "faults.timeline[0].target", "there is no decode engine D1 (engines D0..D0)"),
            ),
            (
                fault("D0.dp*.tp8", "NicDown"),
                (Invalid, "faults.timeline[0].target", "TP rank 8 is out of range (largest: tp7)"),
            ),
            (fault("X0.dp0.tp0", "NicDown"), (Invalid, "faults.timeline[0].target", "not a rank pattern")),
            (fault("P0.dp-1.tp0", "NicDown"), (Invalid, "faults.timeline[0].target", "not a rank pattern")),
            (fault("P0.dp0.tp0.x", "NicDown"), (Invalid, "faults.timeline[0].target", "not a rank pattern")),
            (
                fault("P0.dp99999.tp0", "NicDown"),
                (Invalid, "faults.timeline[0].target", "not a rank pattern"),
            ),
            (
                fault("P1.dp0.tp7", "NicDown")
                    .replace("1P_TP8:", "1P_TP8+1P_TP4:")
                    .replace("faults:", "hardware: (kv_memory_fraction: 0.5), faults:"),
                (Invalid, "faults.timeline[0].target", "TP rank 7 is out of range (largest: tp3)"),
            ),
            (with("faults: (swarm: (loss: -0.1))"), (Invalid, "faults.swarm.loss", "[0, 1]")),
            (with("faults: (transfer_timeout_ms: 0)"), (Invalid, "faults.transfer_timeout_ms", "at least 1")),
            (
                with("faults: (swarm: (send_queue_full: 2))"),
                (Invalid, "faults.swarm.send_queue_full", "[0, 1]"),
            ),
            (
                with("faults: (swarm: (delay: 0.5))"),
                (Invalid, "faults.swarm.max_delay_ms", "when faults.swarm.delay"),
            ),
            // Regressions: each of these once loaded and then misbehaved (a wrapped time, a
            // saturated float, memory without bound). Each is now refused with its limit.
            (
                with("protocol: (collective_timeout_ms: 18446744073709)"),
                (Invalid, "protocol.collective_timeout_ms", "at most 10000000000 ms (about 115 days), got 18446744073709"),
            ),
            (
                with("protocol: (handshake_timeout_ms: 18446744073709551615)"),
                (Invalid, "protocol.handshake_timeout_ms", "at most 10000000000 ms"),
            ),
            (
                with("protocol: (transfer_timeout_ms: 10000000001)"),
                (Invalid, "protocol.transfer_timeout_ms", "got 10000000001"),
            ),
            (with("protocol: (defer_timeout_ms: 99999999999999)"), (Invalid, "protocol.defer_timeout_ms", "at most")),
            (
                fault("D*.dp*.tp*", "DelayMessages(delay_ms: 18446744073709551615)"),
                (Invalid, "faults.timeline[0].fault.delay_ms", "got 18446744073709551615"),
            ),
            (
                fault("P0.dp0.tp0", "SlowListener(service_ms: 18446744073709551615)"),
                (Invalid, "faults.timeline[0].fault.service_ms", "at most 10000000000 ms"),
            ),
            (
                fault("D0.dp0.tp0", "NicDown, duration_ms: 18446744073709551615"),
                (Invalid, "faults.timeline[0].duration_ms", "at most 10000000000 ms"),
            ),
            (
                with("faults: (timeline: [(at_ms: 18446744073709551615, target: \"D0.dp0.tp0\", fault: NicDown)])"),
                (Invalid, "faults.timeline[0].at_ms", "at most 10000000000 ms"),
            ),
            (
                with("faults: (swarm: (delay: 0.5, max_delay_ms: 18446744073709551615))"),
                (Invalid, "faults.swarm.max_delay_ms", "at most 10000000000 ms"),
            ),
            (
                with("engines: (prefill_register_delay_ms: 18446744073709551615)"),
                (Invalid, "engines.prefill_register_delay_ms", "at most 10000000000 ms"),
            ),
            (with("hardware: (nic_gb_s: 1e-15)"), (Invalid, "hardware.nic_gb_s", "between 1e-6 and 1e9, got 1e-15")),
            (with("hardware: (nic_gb_s: 1e300)"), (Invalid, "hardware.nic_gb_s", "between 1e-6 and 1e9")),
            (with("hardware: (fp8_tflops: 1e-300)"), (Invalid, "hardware.fp8_tflops", "between 1e-6 and 1e9")),
            (with("hardware: (hbm_tb_s: 1e-7)"), (Invalid, "hardware.hbm_tb_s", "between 1e-6 and 1e9")),
            (
                with("hardware: (control_latency_us: 1e300)"),
                (Invalid, "hardware.control_latency_us", "at most 1e13 (about 115 days)"),
            ),
            (with("cost: (prefill_fixed_ms: 1e20)"), (Invalid, "cost.prefill_fixed_ms", "at most 1e10")),
            (with("model: (active_params_b: 1e-300)"), (Invalid, "model.active_params_b", "between")),
            (
                with("model: (kv_bytes_per_token_per_layer: 4294967295)"),
                (Invalid, "model.kv_bytes_per_token_per_layer", "at most 1048576"),
            ),
            (with("model: (block_size_tokens: 2000000)"), (Invalid, "model.block_size_tokens", "at most 1048576")),
            (
                fault("P0.dp0.tp0", "SlowNic(factor: 1e-300)"),
                (Invalid, "faults.timeline[0].fault.factor", "at least 1e-6 (a millionth), got 1e-300"),
            ),
            (
                with("workload: (clients: Open(rate_per_s: 1e-300, requests: 5))"),
                (Invalid, "workload.clients.rate_per_s", "between 1e-6 and 1e9"),
            ),
            (
                with("workload: (clients: Closed(concurrency: 10000000, requests: 10))"),
                (Invalid, "workload.clients.concurrency", "at most 100000, got 10000000"),
            ),
            (
                with("workload: (clients: Closed(concurrency: 10, requests: 4294967295))"),
                (Invalid, "workload.clients.requests", "at most 1000000, got 4294967295"),
            ),
            (
                with("workload: (clients: Open(rate_per_s: 1.0, requests: 1000001))"),
                (Invalid, "workload.clients.requests", "at most 1000000"),
            ),
            (
                with("workload: (input_tokens: Fixed(4294967295))"),
                (Invalid, "workload.input_tokens", "at most 1048576 tokens"),
            ),
            (
                with("workload: (output_tokens: Uniform(min: 1, max: 2000000))"),
                (Invalid, "workload.output_tokens.max", "at most 1048576 tokens"),
            ),
            (with("limits: (max_virtual_time_s: 18446744073709551615)"), (Invalid, "limits.max_virtual_time_s", "at most 86400 s")),
            (with("limits: (max_events: 18446744073709551615)"), (Invalid, "limits.max_events", "at most 10000000000")),
            (
                with(&format!("faults: (timeline: [{}])", vec!["(at_ms: 0, target: \"D0.dp0.tp0\", fault: NicDown)"; 1001].join(", "))),
                (Invalid, "faults.timeline", "holds at most 1000 faults, got 1001"),
            ),
            (
                with(&format!("faults: (timeline: [{}])", vec!["(at_ms: 0, target: \"D0.dp0.tp0\", fault: EngineCrash)"; 64].join(", "))),
                (Invalid, "faults.timeline[63].fault", "at most 63 EngineCrash faults"),
            ),
            // A prompt that can never fit a pool would stall forever and look like a hang.
            (
                with("engines: (kv_blocks_per_gpu: 100), workload: (input_tokens: Fixed(1601))"),
                (Invalid, "workload.input_tokens", "the longest prompt needs 101 KV blocks of 16 tokens, but a DP rank of engine P0 (TP8) holds only 100 (engines.kv_blocks_per_gpu)"),
            ),
            (
                with("engines: (kv_blocks_per_gpu: 100), workload: (input_tokens: Uniform(min: 1, max: 1600), output_tokens: Fixed(17))"),
                (Invalid, "workload.output_tokens", "the longest prompt plus the longest output needs 102 KV blocks"),
            ),
            (
                with("hardware: (hbm_gb: 0.001, kv_memory_fraction: 0.5), workload: (input_tokens: Fixed(8192))"),
                (Invalid, "workload.input_tokens", "(hardware.hbm_gb x hardware.kv_memory_fraction)"),
            ),
            (
                with("hardware: (hbm_gb: 100000, kv_memory_fraction: 0.5)"),
                (Invalid, "hardware.hbm_gb", "at most 274877906944 (256 GiB) fit the simulated address space"),
            ),
            (
                with("engines: (kv_blocks_per_gpu: 4000000000), model: (layers: 1, moe_layers: 1, kv_bytes_per_token_per_layer: 1, block_size_tokens: 1)"),
                (Invalid, "engines.kv_blocks_per_gpu", "at most 268435456 are simulated"),
            ),
            // A measurement window and targets that mean nothing.
            (
                with("measure: (warmup_requests: 1000001)"),
                (Invalid, "measure.warmup_requests", "at most 1000000 requests, got 1000001"),
            ),
            (
                with("measure: (warmup_requests: 10, whole_run: true)"),
                (Invalid, "measure.warmup_requests", "cannot be given with measure.whole_run"),
            ),
            (with("slo: ()"), (Invalid, "slo", "must give ttft_ms, tpot_ms or both")),
            (with("slo: (ttft_ms: 0)"), (Invalid, "slo.ttft_ms", "above 0 and at most 10000000000 ms")),
            (with("slo: (ttft_ms: 100, tpot_ms: NaN)"), (Invalid, "slo.tpot_ms", "got NaN")),
            (with("slo: (tpot_ms: 1e11)"), (Invalid, "slo.tpot_ms", "got 100000000000")),
            // Jain bounds that could never hold (or always would).
            (with("expect_jain: (at_least: NaN)"), (Invalid, "expect_jain.at_least", "in [0, 1] (a Jain index), got NaN")),
            (with("expect_jain: (at_most: 1.5)"), (Invalid, "expect_jain.at_most", "got 1.5")),
            (with("expect_jain: (at_least: -0.1)"), (Invalid, "expect_jain.at_least", "got -0.1")),
            (
                with("expect_jain: (at_least: 0.9, at_most: 0.5)"),
                (Invalid, "expect_jain.at_most", "must be at least expect_jain.at_least (0.9), got 0.5"),
            ),
        ];
        for (text, expected) in &table {
            check_err(text, *expected);
        }
    }
}
