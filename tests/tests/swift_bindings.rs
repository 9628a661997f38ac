//! The Swift bindings checked in under clients/swift are what the current
//! greendot-ffi generates (no Swift toolchain runs here: the check is that
//! they are up to date; clients/swift/README.md says what was not compiled).

use greendot_tests::ffi;

/// Where each generated file is kept in the Swift package.
const FILES: [(&str, &str); 3] = [
    ("greendot_ffi.swift", "Sources/Greendot/greendot_ffi.swift"),
    ("greendot_ffiFFI.h", "Headers/greendot_ffiFFI.h"),
    ("greendot_ffiFFI.modulemap", "Headers/module.modulemap"),
];

#[test]
fn checked_in_swift_bindings_are_up_to_date() {
    let (library, bindgen) = ffi::build();
    let out = library.parent().unwrap().join("swift-bindings");
    ffi::generate(&bindgen, &library, "swift", &out);
    let package = ffi::workspace().join("clients/swift");
    let mut generated: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    generated.sort();
    let mut expected: Vec<String> = FILES.iter().map(|(g, _)| g.to_string()).collect();
    expected.sort();
    assert_eq!(
        generated, expected,
        "uniffi-bindgen's Swift output changed shape"
    );
    let stale: Vec<&str> = FILES
        .iter()
        .filter(|(generated, kept)| {
            let new = std::fs::read(out.join(generated)).unwrap();
            std::fs::read(package.join(kept)).ok() != Some(new)
        })
        .map(|(_, kept)| *kept)
        .collect();
    assert!(
        stale.is_empty(),
        "clients/swift is out of date with greendot-ffi ({stale:?} differ): run clients/swift/generate.sh"
    );
}
