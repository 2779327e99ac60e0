//! The GPU map's data (`/map/data`): the `/inspect` document, and the GPU pods waiting to be placed,
//! each with what it asks and why it waits (per reason, how many nodes say it, by the extender's own
//! filter), oldest first.

use super::ClusterState;
use super::inspect::InspectDoc;
use crate::decide::extender::{NO_INVENTORY, engine_request};
use nano_gpu_engine::request::Reason;
use nano_gpu_proto::demand::{CardDemand, PodDemand};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// On how many nodes a demand fits, and for the others how many give each reason.
type Verdict = (usize, BTreeMap<&'static str, usize>);

/// The map's document ([`ClusterState::map`]).
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MapDoc {
    /// Per node and card, as `/inspect` has them.
    #[serde(flatten)]
    pub inspect: InspectDoc,
    /// The view's generation.
    pub generation: u64,
    /// The oldest waiting GPU pods, with what they ask and why they wait.
    pub waiting: Vec<serde_json::Value>,
    /// How many wait in all.
    pub waiting_total: usize,
}

impl ClusterState {
    /// What changed last: equal generations, equal map (and `/inspect`).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// How many GPU pods wait, and the age in seconds of the oldest at `now` (seconds since the
    /// epoch; 0 when none waits or none says when it was created).
    pub fn waiting_now(&self, now: u64) -> (usize, u64) {
        let oldest = self.waiting.values().filter_map(|w| w.created).min();
        let age = oldest.map_or(0, |t| u64::try_from(t).map_or(0, |t| now.saturating_sub(t)));
        (self.waiting.len(), age)
    }

    /// The map's document: [`ClusterState::inspect`]'s nodes, the generation, and the oldest
    /// `limit` waiting GPU pods with their reasons (`waitingTotal` counts them all).
    pub fn map(&mut self, limit: usize) -> MapDoc {
        let mut oldest: Vec<(&String, &super::Waiting)> = self.waiting.iter().collect();
        oldest.sort_by(|a, b| (&a.1.since, &a.1.key).cmp(&(&b.1.since, &b.1.key)));
        let total = oldest.len();
        let chosen: Vec<super::Waiting> = oldest.into_iter().take(limit).map(|(_, w)| w.clone()).collect();
        // Waiting pods mostly ask a few kinds of things: each kind is judged against every node once.
        let mut judged: Vec<(&PodDemand, Verdict)> = Vec::new();
        let waiting: Vec<serde_json::Value> = chosen
            .iter()
            .map(|w| {
                let (fits, reasons) = match judged.iter().find(|(d, _)| **d == w.demand) {
                    Some((_, verdict)) => verdict.clone(),
                    None => {
                        let verdict = self.reasons(&w.demand);
                        judged.push((&w.demand, verdict.clone()));
                        verdict
                    }
                };
                serde_json::json!({
                    "pod": format!("{}/{}", w.key.0, w.key.1), "since": w.since, "asks": asks(&w.demand),
                    "fitsOn": fits, "reasons": reasons,
                })
            })
            .collect();
        MapDoc { inspect: self.inspect_doc(), generation: self.generation, waiting, waiting_total: total }
    }

    /// On how many nodes `demand` fits now, and for the others how many give each reason.
    fn reasons(&mut self, demand: &PodDemand) -> Verdict {
        let req = engine_request(demand, &self.extender.engine().cluster().models);
        let (mut fits, mut reasons) = (0, BTreeMap::new());
        self.extender.judge(&req, self.nodes.keys(), |_, judged| match judged {
            Ok(()) => fits += 1,
            Err(reason) => *reasons.entry(reason.map_or(NO_INVENTORY, Reason::kind)).or_insert(0) += 1,
        });
        (fits, reasons)
    }
}

/// What a pod asks, for a person: each slot (`40%`, `8192 MiB`, `2 whole cards`), then the models.
fn asks(d: &PodDemand) -> String {
    let mut out = String::new();
    for (i, s) in d.slots.iter().enumerate() {
        if i > 0 {
            out.push_str(" + ");
        }
        let _ = match s.demand {
            CardDemand::Share { percent: Some(p), memory: Some(m) } => write!(out, "{}% {} MiB", p.0, m.0),
            CardDemand::Share { percent: Some(p), memory: None } => write!(out, "{}%", p.0),
            CardDemand::Share { percent: None, memory: Some(m) } => write!(out, "{} MiB", m.0),
            CardDemand::Share { percent: None, memory: None } => write!(out, "a share"),
            CardDemand::Whole { cards: 1, .. } => write!(out, "1 whole card"),
            CardDemand::Whole { cards, .. } => write!(out, "{cards} whole cards"),
        };
    }
    if !d.models.is_empty() {
        let _ = write!(out, " of {}", d.models.join(" or "));
    }
    out
}
