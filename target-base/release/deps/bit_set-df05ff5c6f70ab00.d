/work/main/target-base/release/deps/bit_set-df05ff5c6f70ab00.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/iter.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/set.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/util.rs

/work/main/target-base/release/deps/libbit_set-df05ff5c6f70ab00.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/iter.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/set.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/util.rs

/work/main/target-base/release/deps/libbit_set-df05ff5c6f70ab00.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/iter.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/set.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/util.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/lib.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/iter.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/set.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-set-0.11.1/src/util.rs:
