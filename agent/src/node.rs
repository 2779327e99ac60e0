//! What the agent reads from and writes on its node, beside the cards: the Node object (its
//! inventory annotation and labels, [`publish`]), how each share is limited there and the MPS
//! daemons' directories ([`enforce`]), the pods bound to the node and which container a call is for
//! ([`pods`], fed by its pod watch), the kubelet's pod-resources API ([`podresources`]), and the
//! agent's own `/healthz` and `/readyz` ([`probe`]).

pub mod enforce;
pub mod podresources;
pub mod pods;
pub mod probe;
pub mod publish;
