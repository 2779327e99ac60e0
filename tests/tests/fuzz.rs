//! Structured random inputs for every decoder that reads what others write (the entry points of
//! `nano-gpu-fuzz`, `tests/fuzz/src/lib.rs`): annotations, node inventory, extender and
//! AdmissionReview bodies (through the allocator's real HTTP routes), quantities, pod demand, device
//! IDs, the device plugin's gRPC requests (protobuf bytes through Allocate), sysfs and `/proc` trees,
//! cgroup lines and the Prometheus text `top` reads.
//!
//! Each input is either arbitrary or a valid one mutated (bytes flipped, JSON-significant characters
//! inserted, ranges deleted or repeated); each entry point asserts what must hold. Stable Rust,
//! proptest. The budget is proptest's own `PROPTEST_CASES` (256 per property in the test run);
//! `hack/fuzz.sh` runs a larger one, and `hack/fuzz.sh --coverage` drives the same entry points with
//! libFuzzer. A failure prints the smallest input found; each becomes a named regression case at the
//! end of this file.

use nano_gpu_fuzz::samples::*;
use nano_gpu_fuzz::{SEP, join};
use nano_gpu_proto::quantity;
use proptest::prelude::*;

/// Characters that matter to JSON, quantities and our own formats.
const SIGNIFICANT: &[u8] = b"{}[]\":,.-+eE0123456789 \\/_kKmMGi\n\tnul";

/// `valid` with up to 8 edits.
fn mutated(valid: &'static str) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec((any::<u8>(), any::<usize>(), 0..4u8), 0..8).prop_map(move |edits| {
        let mut b = valid.as_bytes().to_vec();
        for (byte, at, kind) in edits {
            if b.is_empty() {
                b.push(byte);
                continue;
            }
            let i = at % b.len();
            let span = (i + 1 + usize::from(byte) % 16).min(b.len());
            match kind {
                0 => b[i] = byte,
                1 => b.insert(i, SIGNIFICANT[usize::from(byte) % SIGNIFICANT.len()]),
                2 => {
                    b.drain(i..span);
                }
                _ => {
                    let piece = b[i..span].to_vec();
                    b.splice(i..i, piece);
                }
            }
        }
        // One part of an input of several: the separator stays out of it.
        b.retain(|c| *c != SEP);
        b
    })
}

/// Arbitrary text, or `valid` mutated.
fn text(valid: &'static str) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![any::<String>().prop_map(String::into_bytes), mutated(valid)]
}

/// Something shaped like a Kubernetes quantity, often almost valid.
fn quantity_like() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[-+]?[0-9]{0,30}(\\.[0-9]{0,12})?([eE][-+]?[0-9]{1,5})?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|n|u)?",
        any::<String>(),
    ]
    .prop_map(String::into_bytes)
}

proptest! {
    #[test]
    fn annotations_decode_or_refuse_and_what_decodes_round_trips(
        a in prop_oneof![text(ASSIGNMENT), text(INVENTORY), text(OVERRUN)],
    ) {
        nano_gpu_fuzz::annotations(&a);
    }

    #[test]
    fn quantities_parse_or_refuse(q in quantity_like(), n in 0u64..1_000_000_000_000) {
        nano_gpu_fuzz::quantities(&q);
        prop_assert_eq!(quantity::whole(&n.to_string()), Ok(n));
        prop_assert_eq!(quantity::mebibytes(&format!("{n}Mi")), Ok(n));
        prop_assert_eq!(quantity::cpu_milli(&format!("{n}m")), Ok(n));
    }

    #[test]
    fn a_pods_demand_is_read_or_refused_whatever_its_limits_and_annotations(
        pod in text(POD), limit in quantity_like(), which in 0..4u8, idx in any::<String>(),
    ) {
        nano_gpu_fuzz::pod_demand(&join(&[&pod, &limit, &[which], idx.as_bytes()]));
    }

    #[test]
    fn device_ids_decode_or_refuse_and_ours_round_trip(
        id in prop_oneof![
            text(DEVICE_ID),
            "[A-Za-z0-9:._-]{1,80}".prop_map(String::into_bytes),
        ],
    ) {
        nano_gpu_fuzz::device_ids(&id);
    }

    #[test]
    fn the_kubelets_device_checkpoint_is_read_as_json_reads_it_or_refused(
        text in prop_oneof![text(CHECKPOINT), mutated(CHECKPOINT)],
    ) {
        nano_gpu_fuzz::kubelet_checkpoint(&text);
    }

    #[test]
    fn cgroup_lines_and_metrics_text_are_read_or_ignored(text in prop_oneof![text(CGROUP), text(METRICS)]) {
        nano_gpu_fuzz::cgroup_and_metrics(&text);
    }

    #[test]
    fn the_device_plugins_grpc_requests_are_served_or_refused(input in prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        prop::collection::vec(text("GPU-a-07"), 0..120).prop_map(|ids| ids.join(&b'\n')),
    ]) {
        nano_gpu_fuzz::allocate(&input);
    }

    #[test]
    fn the_allocators_http_routes_answer_any_body(route in 0..5u8, body in prop_oneof![text(FILTER), text(BIND), text(REVIEW)]) {
        nano_gpu_fuzz::http_routes(&[&[route][..], &body].concat());
    }

    #[test]
    fn sysfs_and_proc_trees_are_read_or_skipped(
        vendor in text("0x8086"), device in text("0x56a0"), numa in text("1"), memory in text("17179869184"),
        vfs in text("0"), stat in text(STAT), cgroup in text(CGROUP),
    ) {
        nano_gpu_fuzz::sysfs_and_proc(&join(&[&vendor, &device, &numa, &memory, &vfs, &stat, &cgroup]));
    }
}

/// Every entry point has seeds (the corpus `hack/fuzz.sh --coverage` starts from) and takes them.
#[test]
fn every_entry_point_has_seeds_it_takes() {
    for (name, run) in nano_gpu_fuzz::TARGETS {
        let seeds = nano_gpu_fuzz::seeds(name);
        assert!(!seeds.is_empty(), "{name} has no seeds");
        for s in seeds {
            run(&s);
        }
    }
}

/// Found when these properties moved to `nano-gpu-fuzz` and the round trip took its UUID from the
/// input: an empty card UUID "fit", and the IDs made of it (`-00`) name no card.
#[test]
fn an_empty_card_uuid_makes_no_ids() {
    assert!(!nano_gpu_proto::device_id::uuid_fits(""));
    nano_gpu_fuzz::device_ids(b"");
}
