//! The FFI crate's library and the workspace's `uniffi-bindgen`, for the
//! tests of the generated bindings (python_client.rs, swift_bindings.rs).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace's root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Builds `greendot-ffi` (its cdylib) and `uniffi-bindgen` in this test's
/// own target directory and profile (a no-op once they are up to date);
/// returns (the library, the bindgen binary).
pub fn build() -> (PathBuf, PathBuf) {
    // This test runs as <target>/<profile>/deps/<test>-<hash>.
    let exe = std::env::current_exe().expect("the test's own path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in <target>/<profile>/deps");
    let target = profile_dir.parent().expect("a target directory");
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(workspace())
        .args([
            "build",
            "-p",
            "greendot-ffi",
            "-p",
            "greendot-uniffi-bindgen",
        ])
        .arg("--target-dir")
        .arg(target);
    if release {
        cargo.arg("--release");
    }
    // What cargo sets for this test is not the inner build's: ring's build
    // script reruns when CARGO_PKG_NAME changes, which would rebuild the
    // client under it at every run.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_")
            || matches!(
                name.as_ref(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            )
        {
            cargo.env_remove(name.as_ref());
        }
    }
    let out = cargo.output().expect("cannot run cargo");
    assert!(
        out.status.success(),
        "cargo build -p greendot-ffi -p greendot-uniffi-bindgen failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let library = profile_dir.join(format!(
        "{}greendot_ffi{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let bindgen = profile_dir.join(format!("uniffi-bindgen{}", std::env::consts::EXE_SUFFIX));
    assert!(library.exists(), "no {}", library.display());
    assert!(bindgen.exists(), "no {}", bindgen.display());
    (library, bindgen)
}

/// Generates `language`'s bindings of `library` into `out` (emptied first),
/// unformatted (the output must not depend on which formatters are
/// installed).
pub fn generate(bindgen: &Path, library: &Path, language: &str, out: &Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).expect("cannot create the bindings' directory");
    let run = Command::new(bindgen)
        .current_dir(workspace())
        .args([
            "generate",
            "--no-format",
            "--language",
            language,
            "--out-dir",
        ])
        .arg(out)
        .arg("--library")
        .arg(library)
        .output()
        .expect("cannot run uniffi-bindgen");
    assert!(
        run.status.success(),
        "uniffi-bindgen generate --language {language} failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
