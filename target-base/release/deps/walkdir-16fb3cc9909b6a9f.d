/work/main/target-base/release/deps/walkdir-16fb3cc9909b6a9f.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/dent.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/error.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/util.rs

/work/main/target-base/release/deps/libwalkdir-16fb3cc9909b6a9f.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/dent.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/error.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/util.rs

/work/main/target-base/release/deps/libwalkdir-16fb3cc9909b6a9f.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/dent.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/error.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/util.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/lib.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/dent.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/error.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/walkdir-2.5.1/src/util.rs:
