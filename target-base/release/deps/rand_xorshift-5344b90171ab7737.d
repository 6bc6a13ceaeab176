/work/main/target-base/release/deps/rand_xorshift-5344b90171ab7737.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/rand_xorshift-0.5.0/src/lib.rs

/work/main/target-base/release/deps/librand_xorshift-5344b90171ab7737.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/rand_xorshift-0.5.0/src/lib.rs

/work/main/target-base/release/deps/librand_xorshift-5344b90171ab7737.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/rand_xorshift-0.5.0/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/rand_xorshift-0.5.0/src/lib.rs:
