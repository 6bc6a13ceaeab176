/work/main/target-base/release/deps/fnv-086a278e64f52513.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fnv-1.0.7/lib.rs

/work/main/target-base/release/deps/libfnv-086a278e64f52513.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fnv-1.0.7/lib.rs

/work/main/target-base/release/deps/libfnv-086a278e64f52513.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fnv-1.0.7/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/fnv-1.0.7/lib.rs:
