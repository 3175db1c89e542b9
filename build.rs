//! Records where a benchmark binary came from, so that every report can say it: the git
//! revision (with `-dirty` when the tree had uncommitted changes), the rustc version, the
//! build profile and the target triple. Read back through `cuda_resident_suite::PROVENANCE`.

use std::process::Command;

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    let revision = output("git", &["rev-parse", "--short=12", "HEAD"]).map(|rev| {
        let dirty =
            output("git", &["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        if dirty { format!("{rev}-dirty") } else { rev }
    });
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = output(&rustc, &["--version"]);
    let unknown = || "unknown".to_owned();
    println!("cargo:rustc-env=PROVENANCE_GIT_REVISION={}", revision.unwrap_or_else(unknown));
    println!("cargo:rustc-env=PROVENANCE_RUSTC={}", rustc_version.unwrap_or_else(unknown));
    println!("cargo:rustc-env=PROVENANCE_PROFILE={}", std::env::var("PROFILE").unwrap_or_else(|_| unknown()));
    println!("cargo:rustc-env=PROVENANCE_TARGET={}", std::env::var("TARGET").unwrap_or_else(|_| unknown()));
    // Rebuild when the checked-out commit or the index (staging, commits) changes.
    for path in [".git/HEAD", ".git/index", ".git/refs/heads"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
