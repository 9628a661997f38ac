//! The TypeScript client's own suite (clients/typescript), run from the
//! README's test command so that one command tests everything: it installs
//! the pinned npm packages (`npm ci`), builds with tsc and runs `node --test`.

use std::path::Path;
use std::process::Command;

#[test]
fn typescript_client_suite_passes() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/typescript/test.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {}: {e} (needs bash, Node >= 20 and npm)",
                script.display()
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "clients/typescript/test.sh failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // node --test prints a summary; a run that tested nothing must not pass.
    let passed = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("# pass "))
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0);
    assert!(passed > 0, "no TypeScript test ran:\n{stdout}");
    assert!(stdout.contains("# fail 0"), "{stdout}");
}
