/work/main/target-base/release/deps/bit_vec-ada35fd8437663ef.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/util.rs

/work/main/target-base/release/deps/libbit_vec-ada35fd8437663ef.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/util.rs

/work/main/target-base/release/deps/libbit_vec-ada35fd8437663ef.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/util.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/lib.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bit-vec-0.10.2/src/util.rs:
