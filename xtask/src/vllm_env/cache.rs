//! Where the vLLM venv, its wheels and pip's cache live: `$PDKV_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/pdkv`, else `~/.cache/pdkv`; never inside the checkout, because a fresh
//! clone (CI's) must find the 4 GB it downloaded the last time, and `git clean` or `cargo clean`
//! must not throw it away.

use std::ffi::OsString;
use std::fmt;
use std::path::{Component, Path, PathBuf};

/// The variable that names the cache folder outright.
pub const CACHE_VAR: &str = "PDKV_CACHE_DIR";

/// The environment the rules read, so that they are a pure function of it.
#[derive(Debug, Default, Clone)]
pub struct CacheVars {
    pub pdkv_cache_dir: Option<OsString>,
    pub xdg_cache_home: Option<OsString>,
    pub home: Option<OsString>,
}

impl CacheVars {
    pub fn from_env() -> Self {
        CacheVars {
            pdkv_cache_dir: std::env::var_os(CACHE_VAR),
            xdg_cache_home: std::env::var_os("XDG_CACHE_HOME"),
            home: std::env::var_os("HOME"),
        }
    }
}

/// Why no cache folder could be chosen.
#[derive(Debug, PartialEq, Eq)]
pub enum CacheError {
    /// `PDKV_CACHE_DIR` is a relative path, which would mean a different folder from each
    /// working directory.
    Relative { path: PathBuf },
    /// Neither variable is set (to an absolute path) and there is no `HOME`.
    NoHome,
    /// The chosen folder is inside the checkout.
    InsideCheckout { path: PathBuf, rule: &'static str, checkout: PathBuf },
}

impl fmt::Display for CacheError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CacheError::Relative { path } => {
                write!(f, "{CACHE_VAR}={} is relative; give an absolute path", path.display())
            }
            CacheError::NoHome => write!(
                f,
                "no cache folder: {CACHE_VAR} and XDG_CACHE_HOME are unset (or not absolute) and HOME is \
                 unset; set {CACHE_VAR} to a folder outside the checkout"
            ),
            CacheError::InsideCheckout { path, rule, checkout } => write!(
                f,
                "the cache folder {} (from {rule}) is inside the checkout {}: a fresh clone would not find \
                 it and `git clean` would delete it; set {CACHE_VAR} to a folder outside it",
                path.display(),
                checkout.display()
            ),
        }
    }
}

/// The cache folder and the rule that chose it (`PDKV_CACHE_DIR`, `$XDG_CACHE_HOME/pdkv` or
/// `~/.cache/pdkv`). An empty variable counts as unset; a relative `XDG_CACHE_HOME` is ignored,
/// as the XDG base directory specification asks. `checkouts` are the checkout's root as given
/// and as the file system resolves it: the folder must be inside neither.
pub fn cache_root(vars: &CacheVars, checkouts: &[&Path]) -> Result<(PathBuf, &'static str), CacheError> {
    let set = |v: &Option<OsString>| v.as_ref().filter(|s| !s.is_empty()).map(PathBuf::from);
    let (path, rule) = if let Some(dir) = set(&vars.pdkv_cache_dir) {
        if !dir.is_absolute() {
            return Err(CacheError::Relative { path: dir });
        }
        (dir, CACHE_VAR)
    } else if let Some(xdg) = set(&vars.xdg_cache_home).filter(|p| p.is_absolute()) {
        (xdg.join("pdkv"), "$XDG_CACHE_HOME/pdkv")
    } else if let Some(home) = set(&vars.home).filter(|p| p.is_absolute()) {
        (home.join(".cache").join("pdkv"), "~/.cache/pdkv")
    } else {
        return Err(CacheError::NoHome);
    };
    let path = normalise(&path);
    for checkout in checkouts {
        let checkout = normalise(checkout);
        if path.starts_with(&checkout) {
            return Err(CacheError::InsideCheckout { path, rule, checkout });
        }
    }
    Ok((path, rule))
}

/// `a/./b/../c` as `a/c`, without the file system.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_folder_rules() {
        let check = |pdkv: Option<&str>,
                     xdg: Option<&str>,
                     home: Option<&str>,
                     expected: Result<(&str, &'static str), CacheError>| {
            let vars = CacheVars {
                pdkv_cache_dir: pdkv.map(OsString::from),
                xdg_cache_home: xdg.map(OsString::from),
                home: home.map(OsString::from),
            };
            let got = cache_root(&vars, &[Path::new("/work/wt"), Path::new("/real/wt")]);
            assert_eq!(got, expected.map(|(p, rule)| (PathBuf::from(p), rule)), "{vars:?}");
        };
        let home = Some("/root");
        check(Some("/srv/cache"), Some("/x"), home, Ok(("/srv/cache", CACHE_VAR)));
        check(None, Some("/x"), home, Ok(("/x/pdkv", "$XDG_CACHE_HOME/pdkv")));
        check(None, None, home, Ok(("/root/.cache/pdkv", "~/.cache/pdkv")));
        // Empty counts as unset; a relative XDG_CACHE_HOME is ignored, a relative
        // PDKV_CACHE_DIR refused.
        check(Some(""), Some(""), home, Ok(("/root/.cache/pdkv", "~/.cache/pdkv")));
        check(None, Some("cache"), home, Ok(("/root/.cache/pdkv", "~/.cache/pdkv")));
        check(Some("cache"), None, home, Err(CacheError::Relative { path: "cache".into() }));
        check(None, None, None, Err(CacheError::NoHome));
        check(None, None, Some("relative"), Err(CacheError::NoHome));
        // Never inside the checkout, however the path is written, nor inside its resolved path.
        check(
            Some("/work/wt/target/cache"),
            None,
            home,
            Err(CacheError::InsideCheckout {
                path: "/work/wt/target/cache".into(),
                rule: CACHE_VAR,
                checkout: "/work/wt".into(),
            }),
        );
        check(
            Some("/work/x/../wt/./c"),
            None,
            home,
            Err(CacheError::InsideCheckout {
                path: "/work/wt/c".into(),
                rule: CACHE_VAR,
                checkout: "/work/wt".into(),
            }),
        );
        check(
            None,
            None,
            Some("/real/wt"),
            Err(CacheError::InsideCheckout {
                path: "/real/wt/.cache/pdkv".into(),
                rule: "~/.cache/pdkv",
                checkout: "/real/wt".into(),
            }),
        );
        // A sibling whose name merely starts with the checkout's is outside it.
        check(Some("/work/wt-cache"), None, home, Ok(("/work/wt-cache", CACHE_VAR)));
    }
}
