//! Compiles the kubelet's gRPC APIs with a pure-Rust protobuf compiler (no protoc needed), when the
//! `grpc` feature is on.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "grpc")]
    {
        let files = [
            "api/deviceplugin_v1beta1.proto",
            "api/podresources_v1.proto",
            "api/dra_v1.proto",
            "api/pluginregistration_v1.proto",
        ];
        let descriptors = protox::compile(files, ["api"])?;
        tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(descriptors)?;
    }
    println!("cargo:rerun-if-changed=api");
    Ok(())
}
