//! The Kotlin binding's suite (clients/kotlin/tests), on the JVM, run from
//! the README's test command: builds greendot-ffi and the workspace's
//! uniffi-bindgen, generates the Kotlin bindings, compiles them with the
//! suite (kotlinc, once; again only when a source changed), starts a server
//! (and a UDP relay the suite cuts and restores) and runs the suite with
//! `java`. Fails with the suite's output when a Kotlin test fails, and when
//! fewer tests ran than the file defines.
//!
//! What it installs when missing: Debian's `openjdk-17-jre-headless` (when
//! there is no `java`) and `libjna-java` (JNA 5.13, its jar in
//! /usr/share/java) with apt-get, as root; the Kotlin compiler 2.4.20 from
//! npm (`kotlin-compiler`, which ships kotlinx-coroutines-core 1.8.0 and
//! kotlin-test), pinned by clients/kotlin/package-lock.json and installed
//! with `npm ci` under the target directory (`kotlin-toolchain/`).

use greendot_tests::ffi;
use std::path::{Path, PathBuf};
use std::process::Command;

const JNA: &str = "/usr/share/java/jna.jar";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kotlin_client_suite_passes() {
    let (library, bindgen) = tokio::task::spawn_blocking(ffi::build).await.unwrap();
    let profile_dir = library.parent().unwrap().to_path_buf();
    let dir = profile_dir.join("kotlin-bindings");
    let generated = dir.join("generated");
    ffi::generate(&bindgen, &library, "kotlin", &generated);
    let kotlin = profile_dir
        .parent()
        .expect("a target directory")
        .join("kotlin-toolchain");
    let suite = ffi::workspace().join("clients/kotlin/tests/GreendotTest.kt");
    let (source, classes) = (suite.clone(), dir.join("classes"));
    let classpath = tokio::task::spawn_blocking(move || {
        install(&kotlin);
        compile(&kotlin, &generated, &source, &classes)
    })
    .await
    .unwrap();

    let defined = std::fs::read_to_string(&suite)
        .unwrap()
        .matches("\n    Case(\"")
        .count();
    let harness = ffi::Harness::start(&dir).await;
    let mut java = Command::new("java");
    java.arg(format!("-Djna.library.path={}", profile_dir.display()))
        .arg("-cp")
        .arg(classpath)
        .arg("GreendotTestKt");
    harness.run_suite("Kotlin", java, defined).await;
}

fn sh(what: &str, command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn has_java() -> bool {
    Command::new("java")
        .arg("-version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Java and JNA from Debian, when missing; the pinned Kotlin compiler into
/// `kotlin` (`npm ci`, skipped when that lock file is installed already).
fn install(kotlin: &Path) {
    let mut debian = Vec::new();
    if !has_java() {
        debian.push("openjdk-17-jre-headless");
    }
    if !Path::new(JNA).exists() {
        debian.push("libjna-java");
    }
    if !debian.is_empty() {
        sh(
            "apt-get update",
            Command::new("apt-get").args(["update", "-q"]),
        );
        sh(
            &format!("apt-get install {}", debian.join(" ")),
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(&debian)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        );
    }

    let pinned = ffi::workspace().join("clients/kotlin");
    let lock = std::fs::read(pinned.join("package-lock.json")).unwrap();
    let installed = kotlin.join("installed-lock.json");
    if std::fs::read(&installed).is_ok_and(|l| l == lock) && kotlinc(kotlin).exists() {
        return;
    }
    std::fs::create_dir_all(kotlin).unwrap();
    for file in ["package.json", "package-lock.json"] {
        std::fs::copy(pinned.join(file), kotlin.join(file)).unwrap();
    }
    sh(
        "npm ci (kotlin-compiler)",
        Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(kotlin),
    );
    // Written last: an interrupted install is redone.
    std::fs::write(&installed, lock).unwrap();
}

fn kotlinc(kotlin: &Path) -> PathBuf {
    kotlin.join("node_modules/kotlin-compiler/bin/kotlinc")
}

fn lib(kotlin: &Path, jar: &str) -> String {
    let path = kotlin.join("node_modules/kotlin-compiler/lib").join(jar);
    assert!(path.exists(), "kotlin-compiler ships no {jar}");
    path.display().to_string()
}

/// Compiles the generated bindings and the suite into `classes` (kotlinc
/// takes most of a minute: skipped when the sources and the compiler are
/// those of the last compile); returns the classpath to run them with.
fn compile(kotlin: &Path, generated: &Path, suite: &Path, classes: &Path) -> String {
    let bindings = generated.join("uniffi/greendot_ffi/greendot_ffi.kt");
    let deps = [
        JNA.to_owned(),
        lib(kotlin, "kotlinx-coroutines-core-jvm.jar"),
        lib(kotlin, "kotlin-test.jar"),
    ]
    .join(":");
    let mut sources = std::fs::read(&bindings).expect("the generated Kotlin bindings");
    sources.extend(std::fs::read(suite).unwrap());
    sources.extend(std::fs::read(kotlin.join("installed-lock.json")).unwrap());
    let stamp = classes.join("compiled-from");
    if std::fs::read(&stamp).ok() != Some(sources.clone()) {
        let _ = std::fs::remove_dir_all(classes);
        sh(
            "kotlinc",
            Command::new(kotlinc(kotlin))
                .args(["-nowarn", "-cp", &deps])
                .arg(&bindings)
                .arg(suite)
                .arg("-d")
                .arg(classes),
        );
        std::fs::write(&stamp, sources).unwrap();
    }
    format!(
        "{}:{}:{deps}",
        classes.display(),
        lib(kotlin, "kotlin-stdlib.jar")
    )
}
