//! The kubelet's gRPC APIs, generated from `proto/api/*.proto` (written from the documented API):
//! the device-plugin API v1beta1 that the agent serves and registers with, the pod-resources API v1
//! it reads to learn which pod got which device IDs, and for DRA nodes the DRA plugin API v1 and the
//! plugin-registration API v1 it registers through.

/// Device-plugin API v1beta1 (`Registration`, `DevicePlugin`).
#[allow(missing_docs, clippy::all)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}

/// Pod-resources API v1 (`PodResourcesLister`).
#[allow(missing_docs, clippy::all)]
pub mod podresources {
    tonic::include_proto!("v1");
}

/// DRA plugin API v1 (`DRAPlugin`).
#[allow(missing_docs, clippy::all)]
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// Plugin-registration API v1 (`Registration`), through which the kubelet finds DRA plugins.
#[allow(missing_docs, clippy::all)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The DRA service version a plugin names in its registration (`PluginInfo.supported_versions`).
pub const DRA_SERVICE: &str = "v1.DRAPlugin";
/// The plugin type of a DRA driver in its registration (`PluginInfo.type`).
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// The only device-plugin API version the kubelet supports.
pub const VERSION: &str = "v1beta1";
/// The kubelet's registration socket, in the device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Device health values.
pub const HEALTHY: &str = "Healthy";
/// Device health values.
pub const UNHEALTHY: &str = "Unhealthy";

#[cfg(test)]
mod tests {
    use super::deviceplugin::{ContainerAllocateResponse, DeviceSpec, RegisterRequest};
    use prost::Message;

    #[test]
    fn register_request_uses_the_upstream_field_numbers() {
        let r = RegisterRequest {
            version: "v1beta1".into(),
            endpoint: "nano-gpu.sock".into(),
            resource_name: "nano-gpu/gpu-percent".into(),
            options: None,
        };
        let mut golden = vec![0x0a, 7];
        golden.extend(b"v1beta1");
        golden.extend([0x12, 13]);
        golden.extend(b"nano-gpu.sock");
        golden.extend([0x1a, 20]);
        golden.extend(b"nano-gpu/gpu-percent");
        assert_eq!(r.encode_to_vec(), golden);
    }

    #[test]
    fn dra_claims_devices_and_plugin_info_use_the_upstream_field_numbers() {
        use super::dra::{Claim, Device};
        use super::pluginregistration::PluginInfo;
        let claim = Claim { namespace: "n".into(), uid: "u".into(), name: "c".into() };
        assert_eq!(claim.encode_to_vec(), [0x0a, 1, b'n', 0x12, 1, b'u', 0x1a, 1, b'c']);
        let device = Device { device_name: "d".into(), share_id: Some(String::new()), ..Default::default() };
        // device_name is field 3; share_id field 5, sent even when empty (proto3 optional).
        assert_eq!(device.encode_to_vec(), [0x1a, 1, b'd', 0x2a, 0]);
        let info =
            PluginInfo { r#type: "T".into(), supported_versions: vec!["v".into()], ..Default::default() };
        assert_eq!(info.encode_to_vec(), [0x0a, 1, b'T', 0x22, 1, b'v']);
    }

    #[test]
    fn device_specs_are_field_3_of_an_allocate_response() {
        let r = ContainerAllocateResponse {
            devices: vec![DeviceSpec {
                container_path: "/dev/dri/card0".into(),
                host_path: "/dev/dri/card0".into(),
                permissions: "rw".into(),
            }],
            ..Default::default()
        };
        let bytes = r.encode_to_vec();
        // Tag of field 3, wire type 2 (length-delimited) = 0x1a.
        assert_eq!(bytes[0], 0x1a);
        assert_eq!(ContainerAllocateResponse::decode(bytes.as_slice()).unwrap(), r);
    }
}
