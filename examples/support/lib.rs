//! Support code shared by the examples and benchmarks of cuda-resident: where the binary
//! came from, the spread of a measurement's samples, and the measurements more than one
//! binary runs.

pub mod alloc_bench;
pub mod random;
mod spread;
pub mod weights;

pub use spread::Spread;

// The workspace README's code blocks, compiled and checked as doc tests (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
mod readme_doctests {}

/// Where this build came from; every benchmark report prints it.
#[derive(Clone, Copy, Debug)]
pub struct Provenance {
    /// `git rev-parse --short=12 HEAD`, with `-dirty` for uncommitted changes.
    pub git_revision: &'static str,
    /// `rustc --version` of the compiler that built this.
    pub rustc: &'static str,
    /// Cargo's profile (`release`, `debug`).
    pub profile: &'static str,
    /// The target triple.
    pub target: &'static str,
}

/// The provenance recorded by the build script.
pub const PROVENANCE: Provenance = Provenance {
    git_revision: env!("PROVENANCE_GIT_REVISION"),
    rustc: env!("PROVENANCE_RUSTC"),
    profile: env!("PROVENANCE_PROFILE"),
    target: env!("PROVENANCE_TARGET"),
};

impl std::fmt::Display for Provenance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "git {} | {} | {} | {}", self.git_revision, self.rustc, self.profile, self.target)
    }
}

#[cfg(test)]
mod tests {
    use super::PROVENANCE;

    #[test]
    fn provenance_is_recorded() {
        assert!(PROVENANCE.rustc.starts_with("rustc "), "{}", PROVENANCE.rustc);
        assert!(!PROVENANCE.profile.is_empty() && PROVENANCE.profile != "unknown");
        assert!(PROVENANCE.target.contains('-'), "{}", PROVENANCE.target);
        assert!(!PROVENANCE.git_revision.is_empty());
    }
}
