//! Serving-stack profiles: what the engine software does that the cost model's mechanisms
//! depend on and that differs between stacks. Today one thing: whether a DP+EP engine hides its
//! expert all-to-alls behind compute by running two micro-batches, one computing while the
//! other communicates (SGLang's two-batch overlap, DeepSeek's dual micro-batch overlap). A
//! scenario picks one with `engines: (stack: "NAME")`; the default is the stack the calibration
//! was fitted on.

/// One serving stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stack {
    /// Lowercase name, as a scenario writes it.
    pub name: &'static str,
    /// The expert all-to-alls of a DP+EP step overlap its compute: the step takes the longer of
    /// the two instead of their sum.
    pub alltoall_overlap: bool,
    /// Where the value comes from: `URL — paraphrase`, or `modelling choice: why`.
    pub source: &'static str,
}

/// The stack of the fitting points (docs/calibration.md) and of every scenario that names none.
pub const DEFAULT: &str = "vllm";

/// Every stack a scenario may name.
pub const STACKS: [Stack; 3] = [
    Stack {
        name: "vllm",
        alltoall_overlap: false,
        source: "modelling choice: the fitting points ran vLLM without its dual-batch overlap (an opt-in \
                 setting); TP8 has no all-to-all, so they cannot tell, and the all-to-all is taken to follow \
                 compute",
    },
    Stack {
        name: "sglang",
        alltoall_overlap: true,
        source: "https://lmsys.org/blog/2025-05-05-large-scale-ep/ — paraphrase: SGLang's two-batch overlap \
                 splits a batch into two micro-batches so that one computes while the other's DeepEP \
                 dispatch or combine is in flight, hiding the all-to-all behind computation",
    },
    Stack {
        name: "deepseek",
        alltoall_overlap: true,
        source: "https://gh.072103.xyz/deepseek-ai/open-infra-index (Day 6, DeepSeek-V3/R1 Inference System \
                 Overview) — paraphrase: prefill and decode run two micro-batches at once so that the \
                 communication of one is hidden behind the computation of the other",
    },
];

/// The stack named `name`.
pub fn find(name: &str) -> Option<&'static Stack> {
    STACKS.iter().find(|s| s.name == name)
}

/// Every stack's name, in table order.
pub fn names() -> Vec<&'static str> {
    STACKS.iter().map(|s| s.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sound() {
        let mut names = names();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), STACKS.len(), "a name is listed twice");
        assert!(find(DEFAULT).is_some());
        for s in &STACKS {
            assert!(
                s.source.starts_with("https://") || s.source.starts_with("modelling choice: "),
                "{}",
                s.name
            );
            assert_eq!(s.name, s.name.to_lowercase());
        }
        assert_eq!(find("trt-llm"), None);
    }
}
