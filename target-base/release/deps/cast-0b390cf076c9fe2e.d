/work/main/target-base/release/deps/cast-0b390cf076c9fe2e.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/cast-0.3.0/src/lib.rs

/work/main/target-base/release/deps/libcast-0b390cf076c9fe2e.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/cast-0.3.0/src/lib.rs

/work/main/target-base/release/deps/libcast-0b390cf076c9fe2e.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/cast-0.3.0/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/cast-0.3.0/src/lib.rs:
