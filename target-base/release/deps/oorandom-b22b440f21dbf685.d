/work/main/target-base/release/deps/oorandom-b22b440f21dbf685.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/oorandom-11.1.5/src/lib.rs

/work/main/target-base/release/deps/liboorandom-b22b440f21dbf685.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/oorandom-11.1.5/src/lib.rs

/work/main/target-base/release/deps/liboorandom-b22b440f21dbf685.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/oorandom-11.1.5/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/oorandom-11.1.5/src/lib.rs:
