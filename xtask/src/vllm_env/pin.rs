//! What the vLLM venv is made of: the pinned vLLM release (version, its wheels' sha256, its
//! Requires-Python), the packages of its requirement list left out and why, and the pinned
//! maturin that builds the pdkv wheel. Moving to another vLLM release is a change here only.

/// The vLLM release pdkv's plugin tests run against. Its wheels' sha256 and Requires-Python
/// are PyPI's (`https://pypi.org/simple/vllm/`); the Requires-Python is checked against the
/// downloaded wheel's METADATA, so it cannot drift from the wheel it came with.
pub const VLLM: VllmPin = VllmPin {
    version: "0.34.0",
    wheels: &[
        // About 240 MB each; the wheel is the machine's, as vLLM's compiled CPU ops are in it.
        Wheel {
            arch: "x86_64",
            platform: "manylinux_2_28_x86_64",
            sha256: "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2",
        },
        Wheel {
            arch: "aarch64",
            platform: "manylinux_2_28_aarch64",
            sha256: "7d96231fc141ad4b3a441292b77362b285b335ca7d1b0e2ab441d4ebde82f405",
        },
    ],
    requires_python: "<3.15,>=3.11",
};

/// What of vLLM's `Requires-Dist` is not installed, each with why. Names as the METADATA spells
/// them; they are compared normalised (PEP 503). `pip install vllm==0.34.0` fails outright on the
/// first: it pins a flashinfer-python that is not on PyPI. The rest serve only GPUs or media
/// inputs (audio, images, video), and the plugin's tests run vLLM on a CPU with text models.
/// Every name must be one vLLM requires, so the list is revisited with each new pin.
pub const EXCLUDED: &[(&str, &str)] = &[
    (
        "flashinfer-python",
        "CUDA attention and sampling kernels; vLLM 0.34.0 pins 0.7.3, which PyPI does not have",
    ),
    ("tilelang", "a compiler of GPU kernels, for vLLM's GPU kernels"),
    ("nvidia-cutlass-dsl", "NVIDIA's CUTLASS DSL, for vLLM's CUDA kernels"),
    ("humming-kernels", "GPU kernels (its cu13 extra: CUDA 13)"),
    ("tokenspeed-mla", "GPU kernels for MLA attention"),
    ("quack-kernels", "CUDA kernels written in the CuTe DSL"),
    ("PyNvVideoCodec", "NVIDIA's GPU video decoder, for video inputs"),
    ("torchaudio", "audio inputs of multimodal models"),
    ("torchvision", "image and video inputs of multimodal models"),
    ("torchcodec", "audio and video decoding, for multimodal inputs"),
];

/// maturin, which builds the pdkv wheel from python/pyproject.toml (its build-system asks for
/// `maturin>=1.16,<2`). `(platform, sha256)` of its Linux wheels for the machines pdkv runs on,
/// from `https://pypi.org/simple/maturin/`.
pub const MATURIN: Package = Package {
    name: "maturin",
    version: "1.16.0",
    wheels: &[
        (
            "manylinux2010_x86_64.manylinux_2_12_x86_64.musllinux_1_1_x86_64",
            "837db2f4d93d4899c3ac393fb3cc9eebf35b6002336e5d574f4a4fb6c49fe283",
        ),
        (
            "manylinux_2_17_aarch64.manylinux2014_aarch64.musllinux_1_1_aarch64",
            "e285ec9eb10243d45d10417178cb2eb76e0cbb184d0aa4378b503489fa12ee78",
        ),
    ],
};

/// A vLLM release: its version, its binary wheels and the Python versions they accept.
pub struct VllmPin {
    pub version: &'static str,
    pub wheels: &'static [Wheel],
    /// The wheels' Requires-Python, as PyPI and the wheel's METADATA write it.
    pub requires_python: &'static str,
}

/// One binary wheel of a release: the machine (`std::env::consts::ARCH`) it is for, its
/// platform tag and its sha256.
pub struct Wheel {
    pub arch: &'static str,
    pub platform: &'static str,
    pub sha256: &'static str,
}

/// A package pinned to a version and the sha256 of its wheels, `(platform tag, sha256)`.
pub struct Package {
    pub name: &'static str,
    pub version: &'static str,
    pub wheels: &'static [(&'static str, &'static str)],
}

impl VllmPin {
    /// The wheel of the machine `arch`, if one is pinned.
    pub fn wheel(&self, arch: &str) -> Option<&'static Wheel> {
        self.wheels.iter().find(|w| w.arch == arch)
    }

    /// `vllm-<version>-cp38-abi3-<platform>.whl`, PyPI's name for a wheel.
    pub fn file_name(&self, wheel: &Wheel) -> String {
        format!("vllm-{}-cp38-abi3-{}.whl", self.version, wheel.platform)
    }

    /// pip's requirements file for the release, with every pinned hash.
    pub fn requirements(&self) -> String {
        pinned_requirement("vllm", self.version, self.wheels.iter().map(|w| w.sha256))
    }
}

impl Package {
    /// pip's requirements file for the package, with every pinned hash.
    pub fn requirements(&self) -> String {
        pinned_requirement(self.name, self.version, self.wheels.iter().map(|(_, sha256)| *sha256))
    }
}

fn pinned_requirement<'a>(name: &str, version: &str, hashes: impl Iterator<Item = &'a str>) -> String {
    let mut text = format!("{name}=={version}");
    for sha256 in hashes {
        text.push_str(&format!(" \\\n    --hash=sha256:{sha256}"));
    }
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_sha256(text: &str) -> bool {
        text.len() == 64 && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }

    #[test]
    fn pins_are_versions_with_sha256_hashes() {
        assert!(VLLM.version.split('.').all(|n| n.parse::<u32>().is_ok()));
        assert!(MATURIN.version.split('.').all(|n| n.parse::<u32>().is_ok()));
        for w in VLLM.wheels {
            assert!(is_sha256(w.sha256), "{}", w.sha256);
            assert!(w.platform.ends_with(w.arch), "{} {}", w.platform, w.arch);
        }
        for (platform, sha256) in MATURIN.wheels {
            assert!(is_sha256(sha256), "{platform}: {sha256}");
        }
        for (name, why) in EXCLUDED {
            assert!(!name.is_empty() && !why.is_empty());
        }
    }

    #[test]
    fn wheel_names_and_requirements() {
        let check = |arch: &str, expected: Option<&str>| {
            assert_eq!(VLLM.wheel(arch).map(|w| VLLM.file_name(w)).as_deref(), expected, "{arch}");
        };
        check("x86_64", Some("vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"));
        check("aarch64", Some("vllm-0.34.0-cp38-abi3-manylinux_2_28_aarch64.whl"));
        check("riscv64", None);
        let reqs = VLLM.requirements();
        assert!(reqs.starts_with("vllm==0.34.0 \\\n    --hash=sha256:79ca4b3c"), "{reqs}");
        assert_eq!(reqs.matches("--hash=sha256:").count(), 2);
        assert!(MATURIN.requirements().starts_with("maturin==1.16.0 \\\n    --hash=sha256:837db2f4"));
    }
}
