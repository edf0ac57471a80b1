//! The gRPC example's messages, client and server are the code
//! `tonic-prost-build` generates from `orders.proto`, kept beside it so that
//! the example builds without `protoc`: this test generates them again and
//! compares. Run it with `REGENERATE_GRPC=1` to rewrite the kept file after
//! changing the proto or upgrading tonic.

use std::path::Path;

#[test]
fn the_examples_grpc_code_is_what_tonic_prost_build_generates_from_its_proto() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/grpc_orders");
    let out = std::env::temp_dir().join(format!("grpc-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let protoc = std::env::var_os("PROTOC").unwrap_or_else(|| "protoc".into());
    if std::process::Command::new(&protoc)
        .arg("--version")
        .output()
        .is_err()
    {
        panic!(
            "protoc ({}) cannot be run: install the protobuf compiler \
             (Debian: apt-get install -y protobuf-compiler) or set PROTOC",
            protoc.to_string_lossy()
        );
    }
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_protos(
            &[example.join("orders.proto")],
            std::slice::from_ref(&example),
        )
        .expect("tonic-prost-build generates orders.proto's code");
    let generated = std::fs::read_to_string(out.join("orders.v1.rs")).unwrap();
    std::fs::remove_dir_all(&out).ok();
    let kept_path = example.join("orders.v1.rs");
    if std::env::var_os("REGENERATE_GRPC").is_some() {
        std::fs::write(&kept_path, &generated).unwrap();
    }
    let kept = std::fs::read_to_string(&kept_path).unwrap_or_default();
    assert!(
        kept == generated,
        "examples/grpc_orders/orders.v1.rs is not what tonic-prost-build generates \
         from orders.proto; run this test with REGENERATE_GRPC=1 to rewrite it"
    );
}
