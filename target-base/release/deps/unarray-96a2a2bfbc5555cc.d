/work/main/target-base/release/deps/unarray-96a2a2bfbc5555cc.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/build.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/map.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/from_iter.rs

/work/main/target-base/release/deps/libunarray-96a2a2bfbc5555cc.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/build.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/map.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/from_iter.rs

/work/main/target-base/release/deps/libunarray-96a2a2bfbc5555cc.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/lib.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/build.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/map.rs /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/from_iter.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/lib.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/build.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/map.rs:
/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/unarray-0.1.4/src/from_iter.rs:
