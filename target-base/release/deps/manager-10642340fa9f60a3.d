/work/main/target-base/release/deps/manager-10642340fa9f60a3.d: rust/core/../../benches/manager.rs rust/core/../../benches/support/decoding.rs rust/core/../../benches/support/floor.rs rust/core/../../benches/support/splitmix64.rs rust/core/../../benches/support/timing.rs rust/core/../../benches/support/tokens.rs

/work/main/target-base/release/deps/manager-10642340fa9f60a3: rust/core/../../benches/manager.rs rust/core/../../benches/support/decoding.rs rust/core/../../benches/support/floor.rs rust/core/../../benches/support/splitmix64.rs rust/core/../../benches/support/timing.rs rust/core/../../benches/support/tokens.rs

rust/core/../../benches/manager.rs:
rust/core/../../benches/support/decoding.rs:
rust/core/../../benches/support/floor.rs:
rust/core/../../benches/support/splitmix64.rs:
rust/core/../../benches/support/timing.rs:
rust/core/../../benches/support/tokens.rs:
