//! Maps read from files that refuse a key written twice: serde's own map reader keeps the last
//! value of a repeated key, so a scenario saying `{"P0": "pdkv", "P0": "vllm-0.33"}` would run
//! with one of its two lines silently ignored.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error, MapAccess, Visitor};

/// The end of the error for a key written twice (the loader reports it as a syntax error).
pub(crate) const WRITTEN_TWICE: &str = "is written twice; each may be written once";

/// Reads a map, refusing a key that comes twice (`#[serde(deserialize_with = "...")]`).
pub fn deserialize<'de, D, V>(deserializer: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(PhantomData<V>);

    impl<'de, V: Deserialize<'de>> Visitor<'de> for Unique<V> {
        type Value = BTreeMap<String, V>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map with each key once")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                if out.contains_key(&key) {
                    return Err(A::Error::custom(format!("the key {key:?} {WRITTEN_TWICE}")));
                }
                let value = map.next_value()?;
                out.insert(key, value);
            }
            Ok(out)
        }
    }

    deserializer.deserialize_map(Unique(PhantomData))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Holder {
        #[serde(deserialize_with = "deserialize")]
        peers: BTreeMap<String, String>,
    }

    fn check(text: &str, expected: Result<&[(&str, &str)], &str>) {
        let got = ron::from_str::<Holder>(text).map(|h| h.peers).map_err(|e| e.to_string());
        match expected {
            Ok(pairs) => {
                let want: BTreeMap<String, String> =
                    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
                assert_eq!(got, Ok(want), "{text}");
            }
            Err(needle) => {
                let error = got.expect_err(text);
                assert!(error.contains(needle), "{text}: {error}");
            }
        }
    }

    #[test]
    fn a_key_written_twice_is_refused_naming_it() {
        check(r#"(peers: {})"#, Ok(&[]));
        check(r#"(peers: {"P0": "pdkv", "D0": "vllm-0.33"})"#, Ok(&[("D0", "vllm-0.33"), ("P0", "pdkv")]));
        check(r#"(peers: {"P0": "pdkv", "P0": "vllm-0.33"})"#, Err("the key \"P0\" is written twice"));
        // ron says where: the line and column of the second key's value.
        check("(peers: {\n  \"P0\": \"pdkv\",\n  \"P0\": \"vllm-0.33\"\n})", Err("3:"));
    }
}
