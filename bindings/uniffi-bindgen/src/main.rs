//! `uniffi-bindgen` at the version greendot-ffi is built with: generate the
//! Python, Swift and Kotlin bindings from the built cdylib, e.g.
//! `cargo run --release -p uniffi-bindgen -- generate --library
//! target/release/libgreendot_ffi.so --language python --out-dir out`.

fn main() {
    uniffi::uniffi_bindgen_main()
}
