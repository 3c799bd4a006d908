//! Compiles proto/baton/v1/baton.proto with a pure-Rust protobuf compiler (no protoc binary).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../proto/baton/v1/baton.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["../proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
