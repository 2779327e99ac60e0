//! A kube client the way kubectl finds its cluster: from `--kubeconfig` when given, else `KUBECONFIG`,
//! `~/.kube/config` or the in-cluster service account.

use std::path::Path;

/// Connects with the kubeconfig at `path`, or the default chain when `None`.
pub async fn connect(path: Option<&Path>) -> Result<kube::Client, kube::Error> {
    let Some(path) = path else {
        return kube::Client::try_default().await;
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(kube::Error::InferKubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(kube::Error::InferKubeconfig)?;
    kube::Client::try_from(config)
}
