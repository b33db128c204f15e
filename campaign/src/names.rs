//! Outcomes and properties by the names files give them: the lists of every one, lookups whose
//! failure says what a name is not, and the serde of fields and maps that hold them (maps keyed
//! by outcome are written in the order of the names, as the files always were).

use std::collections::BTreeMap;

use pdkv_sim::explore::Property;
use pdkv_sim::Outcome;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Every outcome a run can have (the verdict's own list).
pub const OUTCOMES: [Outcome; 6] = Outcome::ALL;

/// Every property an exploration checks.
pub const PROPERTIES: [Property; 7] = [
    Property::Safety,
    Property::ListenerExists,
    Property::NoHang,
    Property::EveryRequestEnds,
    Property::FreedByReleases,
    Property::FailuresExcused,
    Property::Balanced,
];

/// The outcome named `name` (`clean`, `failed_requests`, ...).
pub fn outcome(name: &str) -> Option<Outcome> {
    OUTCOMES.into_iter().find(|o| o.name() == name)
}

/// The property named `name` (`safety`, `no-hang`, ...).
pub fn property(name: &str) -> Option<Property> {
    PROPERTIES.into_iter().find(|p| p.name() == name)
}

/// What a file says of an outcome name no run has.
pub(crate) fn unknown_outcome(name: &str) -> String {
    format!("outcome `{}` is not one pdkv knows", name.chars().take(80).collect::<String>())
}

/// The entries of a map keyed by outcome in the order of the outcomes' names, the order files
/// and summaries list them in.
pub fn in_name_order<T>(map: &BTreeMap<Outcome, T>) -> Vec<(Outcome, &T)> {
    let mut entries: Vec<(Outcome, &T)> = map.iter().map(|(o, v)| (*o, v)).collect();
    entries.sort_by_key(|(o, _)| o.name());
    entries
}

/// An outcome field by name, refusing an unknown one with [`unknown_outcome`]'s words.
pub(crate) mod outcome {
    use super::*;

    pub fn serialize<S: Serializer>(outcome: &Outcome, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(outcome.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Outcome, D::Error> {
        let name = String::deserialize(deserializer)?;
        super::outcome(&name).ok_or_else(|| D::Error::custom(unknown_outcome(&name)))
    }
}

/// A map keyed by outcome name, written in name order; an unknown name is refused.
pub(crate) mod outcome_map {
    use super::*;

    pub fn serialize<S: Serializer, T: Serialize>(
        map: &BTreeMap<Outcome, T>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.collect_map(in_name_order(map).into_iter().map(|(o, v)| (o.name(), v)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<Outcome, T>, D::Error> {
        let named = BTreeMap::<String, T>::deserialize(deserializer)?;
        let mut map = BTreeMap::new();
        for (name, value) in named {
            let outcome = super::outcome(&name).ok_or_else(|| D::Error::custom(unknown_outcome(&name)))?;
            map.insert(outcome, value);
        }
        Ok(map)
    }
}

/// The properties a failure broke, by name (`broken`); an unknown name is refused, listing the
/// properties there are.
pub(crate) mod broken {
    use super::*;

    pub fn serialize<S: Serializer>(broken: &[Property], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(broken.iter().map(|p| p.name()))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Property>, D::Error> {
        let names = Vec::<String>::deserialize(deserializer)?;
        names
            .iter()
            .map(|name| {
                super::property(name).ok_or_else(|| {
                    let known: Vec<&str> = PROPERTIES.iter().map(|p| p.name()).collect();
                    D::Error::custom(format!(
                        "`broken` names {:?}, which is not a property (they are {})",
                        name.chars().take(80).collect::<String>(),
                        known.join(", ")
                    ))
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_and_property_is_found_by_its_name() {
        for o in OUTCOMES {
            assert_eq!(outcome(o.name()), Some(o));
            // The names files use are serde's names of the outcome.
            assert_eq!(serde_json::to_string(&o).expect("serialises"), format!("\"{}\"", o.name()));
        }
        for p in PROPERTIES {
            assert_eq!(property(p.name()), Some(p));
        }
        assert_eq!(outcome("fine"), None);
        assert_eq!(property("banana"), None);
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Fields {
        #[serde(with = "outcome_map")]
        counts: BTreeMap<Outcome, u64>,
        #[serde(with = "broken")]
        broken: Vec<Property>,
    }

    /// (JSON, what it reads as or the error's words); what reads is written back as it was.
    #[test]
    fn names_read_back_as_written_in_name_order() {
        let check = |json: &str, expected: Result<Fields, &str>| match (
            serde_json::from_str::<Fields>(json),
            expected,
        ) {
            (Ok(fields), Ok(want)) => {
                assert_eq!(fields, want, "{json}");
                assert_eq!(serde_json::to_string(&fields).expect("serialises"), json);
            }
            (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{json}: {e} lacks {want:?}"),
            (got, want) => panic!("{json}: {got:?}, expected {want:?}"),
        };
        // `failed_requests` sorts before `incomplete` by name, after it by severity.
        check(
            r#"{"counts":{"clean":1,"failed_requests":2,"incomplete":3},"broken":["no-hang","safety"]}"#,
            Ok(Fields {
                counts: [(Outcome::Incomplete, 3), (Outcome::FailedRequests, 2), (Outcome::Clean, 1)].into(),
                broken: vec![Property::NoHang, Property::Safety],
            }),
        );
        check(r#"{"counts":{"fine":1},"broken":[]}"#, Err("outcome `fine` is not one pdkv knows"));
        check(
            r#"{"counts":{},"broken":["banana"]}"#,
            Err("`broken` names \"banana\", which is not a property (they are safety, listener-exists"),
        );
        check(r#"{"counts":{"clean":-1},"broken":[]}"#, Err("invalid value: integer `-1`, expected u64"));
    }
}
