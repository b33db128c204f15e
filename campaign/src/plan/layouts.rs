//! The layouts `pdkv plan` considers for a GPU budget: every engine shape of one side (TP-only,
//! DPxEP and DPxTP with EP for a mixture-of-experts model), every pair of prefill and decode
//! engine counts that fits the budget, and whether each engine's GPUs hold its weights and the
//! KV of one request of the workload (a layout that does not fit is rejected with the reason).

use std::fmt;

use pdkv_core::topology::{Layout, MAX_ENGINES_PER_ROLE};
use pdkv_sim::cost::Cost;
use pdkv_sim::scenario::Scenario;
use serde::Serialize;

/// One side of a candidate: how many engines, and the layout every one of them has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Side {
    /// Engines on the side.
    pub engines: u16,
    /// The layout of each engine.
    pub layout: Layout,
}

impl Side {
    /// GPUs the side occupies.
    pub fn gpus(self) -> u32 {
        u32::from(self.engines) * self.layout.ranks()
    }
}

/// A deployment the search considers: homogeneous prefill engines and homogeneous decode
/// engines (a mixed side is left to `pdkv sweep`, since it multiplies the search).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Candidate {
    /// The prefill engines.
    pub prefill: Side,
    /// The decode engines.
    pub decode: Side,
}

impl Candidate {
    /// Its notation, e.g. `2P_TP8:1D_DP8EP`.
    pub fn notation(&self) -> String {
        format!(
            "{}P_{}:{}D_{}",
            self.prefill.engines, self.prefill.layout, self.decode.engines, self.decode.layout
        )
    }

    /// GPUs of both sides.
    pub fn gpus(&self) -> u32 {
        self.prefill.gpus() + self.decode.gpus()
    }
}

/// Which side of a deployment a reason is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SideName {
    Prefill,
    Decode,
}

impl fmt::Display for SideName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SideName::Prefill => "prefill",
            SideName::Decode => "decode",
        })
    }
}

/// Why an engine layout cannot serve the workload on the budget's GPUs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "what", rename_all = "snake_case")]
pub enum MemoryMiss {
    /// The weights and the activation reserve leave under 1 GB of KV cache per GPU (the
    /// simulator's own rule, `cost::kv_room`).
    Weights { side: SideName, layout: String, weights_gb: f64, reserve_gb: f64, usable_gb: f64 },
    /// The KV pool of one DP group holds less than one request of the workload's longest
    /// lengths (prompt alone on the prefill side, prompt and answer on the decode side, which
    /// reserves the whole answer at admission).
    Kv { side: SideName, layout: String, blocks: u32, needed: u32 },
}

impl fmt::Display for MemoryMiss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryMiss::Weights { side, layout, weights_gb, reserve_gb, usable_gb } => write!(
                f,
                "{side} {layout}: weights {weights_gb:.1} GB per GPU and the {reserve_gb} GB activation reserve \
                 leave under 1 GB of KV cache of {usable_gb:.1} GB usable"
            ),
            MemoryMiss::Kv { side, layout, blocks, needed } => write!(
                f,
                "{side} {layout}: a DP group's KV pool of {blocks} blocks holds no whole request \
                 ({needed} blocks needed)"
            ),
        }
    }
}

/// KV blocks one request of `tokens` tokens takes.
pub fn blocks_for(tokens: u32, block_size_tokens: u32) -> u32 {
    tokens.div_ceil(block_size_tokens.max(1))
}

/// Whether one engine of `layout` on `side` holds its weights and one request of `tokens`
/// tokens, by the simulator's own memory model (`Cost::kv_bytes_per_gpu`, `kv_blocks_per_gpu`).
pub fn memory_fit(
    sc: &Scenario,
    cost: &Cost,
    side: SideName,
    layout: Layout,
    tokens: u32,
) -> Result<u32, MemoryMiss> {
    let kv = cost.kv_bytes_per_gpu(layout);
    if sc.engines.kv_blocks_per_gpu == 0 && sc.hardware.kv_memory_fraction <= 0.0 && (kv.is_nan() || kv < 1e9)
    {
        return Err(MemoryMiss::Weights {
            side,
            layout: layout.to_string(),
            weights_gb: cost.weight_bytes_per_gpu(layout) / 1e9,
            reserve_gb: sc.cost.activation_reserve_gb,
            usable_gb: sc.hardware.hbm_gb * sc.engines.gpu_memory_utilization,
        });
    }
    let blocks = if sc.engines.kv_blocks_per_gpu > 0 {
        sc.engines.kv_blocks_per_gpu
    } else {
        cost.kv_blocks_per_gpu(layout)
    };
    let needed = blocks_for(tokens, sc.model.block_size_tokens);
    if blocks < needed {
        return Err(MemoryMiss::Kv { side, layout: layout.to_string(), blocks, needed });
    }
    Ok(blocks)
}

/// The engine layouts of one side for a budget of `gpus`: TP sizes in powers of two up to a node
/// (a TP group spans one scale-up fabric), and for a mixture-of-experts model (`moe`) DP sizes
/// from 2 with expert parallelism over the whole engine (`DP8EP`, `DP4TP2EP`). A dense model's
/// DP groups without EP are independent replicas, which more engines of the TP layout already
/// are, so it gets TP layouts alone. Each engine leaves at least one GPU for the other side.
pub fn engine_layouts(gpus: u32, gpus_per_node: u16, moe: bool) -> Vec<Layout> {
    let room = gpus.saturating_sub(1);
    let tps: Vec<u16> = [1u16, 2, 4, 8, 16, 32, 64]
        .into_iter()
        .filter(|&tp| tp <= gpus_per_node.max(1) && u32::from(tp) <= room)
        .collect();
    let mut out: Vec<Layout> = tps.iter().map(|&tp| Layout::tp(tp)).collect();
    if moe {
        for dp in [2u16, 4, 8, 16, 32, 64, 128, 256] {
            for &tp in &tps {
                let layout = Layout::new(dp, tp, true);
                if layout.ranks() <= room {
                    out.push(layout);
                }
            }
        }
    }
    out
}

/// Every candidate of the budget from the side layouts: each pair of layouts, with every engine
/// count on each side that keeps the total within `gpus` (at most the notation's engines per
/// side), in a fixed order (prefill layout, decode layout, then counts).
pub fn candidates(gpus: u32, prefill: &[Layout], decode: &[Layout]) -> Vec<Candidate> {
    let mut out = Vec::new();
    for &p in prefill {
        for &d in decode {
            let (pr, dr) = (p.ranks(), d.ranks());
            for np in 1..=MAX_ENGINES_PER_ROLE {
                let used = u32::from(np) * pr;
                if used + dr > gpus {
                    break;
                }
                for nd in 1..=MAX_ENGINES_PER_ROLE {
                    if used + u32::from(nd) * dr > gpus {
                        break;
                    }
                    out.push(Candidate {
                        prefill: Side { engines: np, layout: p },
                        decode: Side { engines: nd, layout: d },
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (budget, GPUs per node, MoE) -> the layouts of one side, in notation.
    #[test]
    fn engine_layouts_table() {
        let check = |gpus: u32, node: u16, moe: bool, expected: &[&str]| {
            let got: Vec<String> = engine_layouts(gpus, node, moe).iter().map(Layout::to_string).collect();
            assert_eq!(got, expected, "{gpus} GPUs, node {node}, moe {moe}");
        };
        check(16, 8, false, &["TP1", "TP2", "TP4", "TP8"]);
        check(4, 8, false, &["TP1", "TP2"]);
        check(
            12,
            8,
            true,
            &["TP1", "TP2", "TP4", "TP8", "DP2EP", "DP2TP2EP", "DP2TP4EP", "DP4EP", "DP4TP2EP", "DP8EP"],
        );
        check(3, 4, true, &["TP1", "TP2", "DP2EP"]);
    }

    /// (budget, side layouts) -> the candidates' notations.
    #[test]
    fn candidates_fill_the_budget_at_most() {
        let check = |gpus: u32, p: &[Layout], d: &[Layout], expected: &[&str]| {
            let got: Vec<String> = candidates(gpus, p, d).iter().map(Candidate::notation).collect();
            assert_eq!(got, expected, "{gpus}");
            for c in candidates(gpus, p, d) {
                assert!(c.gpus() <= gpus, "{}", c.notation());
            }
        };
        check(
            4,
            &[Layout::tp(1), Layout::tp(2)],
            &[Layout::tp(2)],
            &["1P_TP1:1D_TP2", "2P_TP1:1D_TP2", "1P_TP2:1D_TP2"],
        );
        check(16, &[Layout::tp(8)], &[Layout::new(8, 1, true)], &["1P_TP8:1D_DP8EP"]);
        check(15, &[Layout::tp(8)], &[Layout::tp(8)], &[]);
    }

    /// (GPU memory, layout, tokens) -> fits with this many blocks, or the reason in words.
    #[test]
    fn memory_fit_table() {
        let sc = Scenario::from_notation("1P_TP8:1D_TP8");
        let cost = Cost::of(&sc);
        let check = |layout: Layout, tokens: u32, expected: Result<u32, &str>| {
            let got = memory_fit(&sc, &cost, SideName::Decode, layout, tokens).map_err(|e| e.to_string());
            match (got, expected) {
                (Ok(blocks), Ok(want)) => assert_eq!(blocks, want, "{layout}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{layout}: {e} lacks {want:?}"),
                (got, _) => panic!("{layout}: {got:?}, expected {expected:?}"),
            }
        };
        // DeepSeek-R1 on the default 192 GB GPUs: TP8 fits (cost.rs's own figures), TP4 does not.
        check(Layout::tp(8), 9216, Ok(cost.kv_blocks_per_gpu(Layout::tp(8))));
        check(Layout::tp(4), 9216, Err("decode TP4: weights 167.8 GB per GPU"));
        check(Layout::tp(8), 100_000_000, Err("holds no whole request (6250000 blocks needed)"));
    }
}
