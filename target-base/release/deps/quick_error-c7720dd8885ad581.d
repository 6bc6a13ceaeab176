/work/main/target-base/release/deps/quick_error-c7720dd8885ad581.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/quick-error-1.2.3/src/lib.rs

/work/main/target-base/release/deps/libquick_error-c7720dd8885ad581.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/quick-error-1.2.3/src/lib.rs

/work/main/target-base/release/deps/libquick_error-c7720dd8885ad581.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/quick-error-1.2.3/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/quick-error-1.2.3/src/lib.rs:
