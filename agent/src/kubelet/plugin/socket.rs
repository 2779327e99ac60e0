//! The plugin's unix socket and the kubelet's registration: bind (removing a stale file), serve the
//! gRPC service until shutdown, register the resource with the kubelet (with a timeout).

use super::Plugin;
use crate::cards::resource::Resource;
use nano_gpu_proto::kubelet::VERSION;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use nano_gpu_proto::kubelet::deviceplugin::registration_client::RegistrationClient;
use nano_gpu_proto::kubelet::deviceplugin::{DevicePluginOptions, RegisterRequest};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::Status;
use tonic::transport::Server;

/// How long the kubelet may take to answer a registration.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds the plugin's socket, removing a stale file first.
pub fn bind(socket: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let _ = std::fs::remove_file(socket);
    tokio::net::UnixListener::bind(socket)
}

/// Serves the plugin on `socket` (a stale file is removed first) until `shutdown` resolves.
pub async fn serve(
    socket: &Path,
    plugin: Plugin,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    serve_on(bind(socket)?, plugin, shutdown).await
}

/// Serves a device plugin (ours, or the keeper's relay to it) on a bound socket until `shutdown`
/// resolves.
pub async fn serve_on<S: DevicePlugin>(
    listener: tokio::net::UnixListener,
    plugin: S,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    Server::builder()
        .add_service(DevicePluginServer::new(plugin))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// What the plugins ask of the kubelet: PreStartContainer before every container (the repair check,
/// the driver's memory limit), and GetPreferredAllocation (steering to the assigned cards).
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true }
}

/// Registers `resource` with the kubelet; the plugin serves on `endpoint` (a file name) in the
/// kubelet's directory.
pub async fn register(kubelet_socket: PathBuf, resource: Resource, endpoint: &str) -> Result<(), Status> {
    let channel = nano_gpu_runtime::unix_channel(kubelet_socket)
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let request = RegisterRequest {
        version: VERSION.into(),
        endpoint: endpoint.into(),
        resource_name: resource.name().into(),
        options: Some(options()),
    };
    // A kubelet that accepts the connection but never answers must not hold the agent forever.
    tokio::time::timeout(REGISTER_TIMEOUT, RegistrationClient::new(channel).register(request))
        .await
        .map_err(|_| Status::unavailable("the kubelet did not answer the registration in time"))??;
    Ok(())
}

/// Whether something accepts connections on the socket at `path`.
pub async fn is_served(path: &Path) -> bool {
    tokio::net::UnixStream::connect(path).await.is_ok()
}

/// Removes the socket files in `dir` whose names `ours` takes and that nobody serves.
pub async fn remove_unserved(dir: &Path, ours: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    for name in names.into_iter().filter(|n| ours(n)) {
        let path = dir.join(&name);
        if !is_served(&path).await {
            tracing::info!(socket = %name, "removing a plugin socket nobody serves");
            let _ = std::fs::remove_file(&path);
        }
    }
}
