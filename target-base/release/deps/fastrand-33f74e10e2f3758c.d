/work/main/target-base/release/deps/fastrand-33f74e10e2f3758c.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/global_rng.rs

/work/main/target-base/release/deps/libfastrand-33f74e10e2f3758c.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/global_rng.rs

/work/main/target-base/release/deps/libfastrand-33f74e10e2f3758c.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/global_rng.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/lib.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fastrand-2.5.0/src/global_rng.rs:
