//! Guides: how the pieces work together, one topic each.
//!
//! The crate's front page says what the crate guarantees and lists these
//! guides; each module's own docs hold its API reference.

pub mod deploying {
    #![doc = include_str!("../docs/deploying.md")]
}

pub mod request_flow {
    #![doc = include_str!("../docs/request_flow.md")]
}

pub mod modes {
    #![doc = include_str!("../docs/modes.md")]
}

pub mod fingerprints {
    #![doc = include_str!("../docs/fingerprints.md")]
}

pub mod transaction {
    #![doc = include_str!("../docs/transaction.md")]
}

pub mod functions {
    #![doc = include_str!("../docs/functions.md")]
}

pub mod grpc {
    #![doc = include_str!("../docs/grpc.md")]
}

pub mod replays {
    #![doc = include_str!("../docs/replays.md")]
}

pub mod long_running {
    #![doc = include_str!("../docs/long_running.md")]
}

pub mod custom_stores {
    #![doc = include_str!("../docs/custom_stores.md")]
}

pub mod outbox {
    #![doc = include_str!("../docs/outbox.md")]
}

#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client {
    #![doc = include_str!("../docs/client.md")]
}

pub mod retention {
    #![doc = include_str!("../docs/retention.md")]
}

pub mod migrations {
    #![doc = include_str!("../docs/migrations.md")]
}

pub mod observability {
    #![doc = include_str!("../docs/observability.md")]
}

pub mod performance {
    #![doc = include_str!("../docs/performance.md")]
}

#[cfg(test)]
mod tests {
    /// The labels of the link definitions (`[label]: target`) in a text,
    /// from lines that start with one (after `prefix`).
    fn definitions<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines()
            .filter_map(|line| line.strip_prefix(prefix)?.strip_prefix('['))
            .filter_map(|rest| rest.split_once("]: ").map(|(label, _)| label))
            .collect()
    }

    /// README links guides and files by their place in the repository,
    /// which is broken on docs.rs: every label it defines must be defined
    /// again, first, in lib.rs's front page (a guide module, or the file on
    /// GitHub), where the first definition wins.
    #[test]
    fn every_link_label_of_the_readme_resolves_in_rustdoc() {
        let readme = definitions(include_str!("../README.md"), "");
        let front = definitions(include_str!("lib.rs"), "//! ");
        assert!(
            readme.len() > 10 && front.len() > 10,
            "{readme:?} {front:?}"
        );
        let missing: Vec<_> = readme.iter().filter(|l| !front.contains(l)).collect();
        assert!(
            missing.is_empty(),
            "README link labels with no definition in lib.rs: {missing:?}"
        );
    }
}
