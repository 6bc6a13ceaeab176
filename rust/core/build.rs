//! Sets `cfg(optimized)` in optimized builds, so the tests size their workloads by speed: the
//! `ci` profile is optimized with debug assertions on, so `debug_assertions` cannot tell.
fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(optimized)");
    if std::env::var("OPT_LEVEL").is_ok_and(|level| level != "0") {
        println!("cargo::rustc-cfg=optimized");
    }
}
