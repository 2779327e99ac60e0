//! The kubelet device plugin for `nano-gpu/gpu-percent`: every card advertises 100 virtual device IDs
//! `<uuid>-NN`, and `Allocate` derives the card(s) from the IDs the kubelet actually chose, so what a
//! container sees always matches the kubelet's own per-ID accounting.
//!
//! Handlers read snapshots of the cards and of the pods on the node (no NVML or API call on the request
//! path). With an [`Identity`], GetPreferredAllocation steers the kubelet to the cards the pod's
//! assignment names, Allocate refuses IDs no placed pod can own, and PreStartContainer queues a check
//! of the assignment against what the kubelet really allocated (`repair`).
//!
//! This file is the gRPC service (decode, delegate, encode); the rest is one job per file:
//! [`devices`](mod@devices) (IDs ↔ cards), [`edits`] (what a container gets), [`identity`] (which
//! container a call is for), [`socket`] (serving and registering).

pub mod devices;
pub mod edits;
pub mod identity;
pub mod socket;
#[cfg(test)]
mod tests;

pub use devices::{derive, devices, prefer};
pub use edits::{Claimed, DEVICE_LIST_MOUNTS, DeviceList, Edits, allocate, container_edits};
pub use identity::{Identity, Report};
pub use socket::{bind, options, register, serve, serve_on};

use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use crate::node::enforce::driver::{DriverLimit, MemoryLimit, PodLimit};
use futures::Stream;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::DevicePlugin;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions, Empty,
    ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// The cards as the handlers see them.
pub type Snapshot = Arc<Vec<Card>>;

/// The gRPC service for one resource.
pub struct Plugin {
    cards: watch::Receiver<Snapshot>,
    resource: Resource,
    edits: Edits,
    identity: Option<Arc<Identity>>,
}

impl Plugin {
    /// Serving `resource` on the cards `cards` carries (updated by the inventory loop). Without
    /// `identity` every container gets what its IDs say and GetPreferredAllocation packs cards.
    pub fn new(
        cards: watch::Receiver<Snapshot>,
        resource: Resource,
        edits: Edits,
        identity: Option<Arc<Identity>>,
    ) -> Self {
        Plugin { cards, resource, edits, identity }
    }

    /// Sets the driver's memory limit for a share (one NVIDIA card, less than whole) on its pod's
    /// cgroup: what the pod holds on that card. A failure fails the call, so the kubelet starts the
    /// container later (and calls again) instead of starting it unlimited.
    async fn limit_memory(
        &self,
        limit: &Arc<DriverLimit>,
        cards: &[Card],
        ids: &[String],
    ) -> Result<(), Status> {
        let got = derive(cards, ids)?;
        let [(card, n)] = got.as_slice() else { return Ok(()) };
        if card.info.vendor != Vendor::Nvidia || u64::from(*n) >= self.resource.card_units(card) {
            return Ok(());
        }
        let identity = self.identity.as_ref().ok_or_else(|| {
            Status::failed_precondition(
                "the driver's memory limit needs --node-name: which pod a share is for",
            )
        })?;
        let (pod, uid, memory) = identity.holding(ids, card).await.map_err(Status::unavailable)?;
        let (limit, uuid) = (limit.clone(), card.info.uuid.clone());
        let set = tokio::task::spawn_blocking(move || limit.limit_pod(&uuid, &uid, memory))
            .await
            .map_err(|e| Status::internal(format!("setting the memory limit: {e}")))?;
        match set {
            Ok(cgroup) => {
                tracing::info!(%pod, card = %card.info.uuid, memory_mib = memory.0, cgroup = %cgroup.display(), "driver memory limit set");
                Ok(())
            }
            Err(e) => {
                Err(Status::unavailable(format!("pod {pod}: the driver's memory limit was not set: {e}")))
            }
        }
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    type ListAndWatchStream = DeviceStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.cards.clone();
        let resource = self.resource;
        let stream = async_stream(move |tx| async move {
            loop {
                let snapshot = rx.borrow_and_update().clone();
                if tx.send(Ok(ListAndWatchResponse { devices: devices(&snapshot, resource) })).await.is_err()
                {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    // The kubelet's calls each in a span with its resource (what the handlers log says which call and
    // which resource it was for; the pods they name are in their own lines).
    #[tracing::instrument(name = "preferred allocation", skip_all, fields(resource = self.resource.name()))]
    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for r in &request.into_inner().container_requests {
            let size = r.allocation_size.max(0) as usize;
            let (available, must) = (&r.available_device_i_ds, &r.must_include_device_i_ds);
            let device_i_ds = match &self.identity {
                Some(identity) => identity.prefer(available, must, size).await,
                None => prefer(available, must, size),
            };
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds });
        }
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    #[tracing::instrument(name = "allocate", skip_all, fields(resource = self.resource.name()))]
    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let cards = self.cards.borrow().clone();
        let mut container_responses = Vec::new();
        for r in &request.into_inner().container_requests {
            let got = derive(&cards, &r.devices_ids)?;
            let claimed = match &self.identity {
                Some(identity) => {
                    let uuids = got.iter().map(|(c, _)| c.info.uuid.as_str()).collect();
                    Some(identity.claim(&r.devices_ids, &uuids).await?)
                }
                None => None,
            };
            let response = allocate(&cards, &r.devices_ids, claimed.as_ref(), self.resource, &self.edits)?;
            container_responses.push(response);
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    #[tracing::instrument(name = "pre-start", skip_all, fields(resource = self.resource.name()))]
    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let ids = request.into_inner().devices_ids;
        let cards = self.cards.borrow().clone();
        derive(&cards, &ids)?;
        if let MemoryLimit::Driver(limit) = &self.edits.memory {
            self.limit_memory(limit, &cards, &ids).await?;
        }
        if let Some(identity) = &self.identity {
            // Checked in the background: the container already has what its IDs say.
            let report = Report::Starting { ids, cards, resource: self.resource };
            if identity.reports.try_send(report).is_err() {
                tracing::warn!("repair queue full; a container start is not verified");
            }
        }
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A stream fed by a task through a channel.
fn async_stream<F, Fut>(body: F) -> DeviceStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<ListAndWatchResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(body(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
