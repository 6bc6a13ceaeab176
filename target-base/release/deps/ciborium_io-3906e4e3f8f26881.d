/work/main/target-base/release/deps/ciborium_io-3906e4e3f8f26881.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/ciborium-io-0.2.2/src/lib.rs

/work/main/target-base/release/deps/libciborium_io-3906e4e3f8f26881.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/ciborium-io-0.2.2/src/lib.rs

/work/main/target-base/release/deps/libciborium_io-3906e4e3f8f26881.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/ciborium-io-0.2.2/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/ciborium-io-0.2.2/src/lib.rs:
