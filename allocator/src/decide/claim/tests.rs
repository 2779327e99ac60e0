use super::*;
use serde_json::json;

fn claim(requests: Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "t", "uid": "u-1", "resourceVersion": "7"},
        "spec": {"devices": {"requests": requests}},
    }))
    .unwrap()
}

fn exactly(extra: Value) -> Value {
    let mut e = json!({"deviceClassName": CLASS});
    for (k, v) in extra.as_object().unwrap() {
        e[k] = v.clone();
    }
    json!([{"name": "gpu", "exactly": e}])
}

fn slots(c: &ResourceClaim) -> Result<Vec<SlotDemand>, String> {
    match ClaimRecord::of(c).class {
        Class::Ours(s) => s.map(|s| s.into_iter().map(|s| s.demand).collect()),
        Class::Other => panic!("not ours"),
    }
}

#[test]
fn requests_become_shares_or_whole_cards() {
    let share = |p: u32| SlotDemand::Share { percent: Some(Percent(p)), mem: None };
    let c = claim(exactly(json!({"capacity": {"requests": {"percent": "30"}}})));
    assert_eq!(slots(&c), Ok(vec![share(30)]));
    let c = claim(exactly(json!({"count": 2})));
    assert_eq!(slots(&c), Ok(vec![SlotDemand::Whole { cards: 2, mem: None }]));
    let c = claim(exactly(json!({"count": 3, "capacity": {"requests": {"percent": "100"}}})));
    assert_eq!(slots(&c), Ok(vec![SlotDemand::Whole { cards: 3, mem: None }]));
    let c = claim(exactly(json!({"capacity": {"requests": {"memory": "4Gi"}}})));
    assert_eq!(slots(&c), Ok(vec![SlotDemand::Share { percent: None, mem: Some(MiB(4096)) }]));
    let c = claim(exactly(json!({"capacity": {"requests": {"percent": "20", "memory": "1Gi"}}})));
    assert_eq!(slots(&c), Ok(vec![SlotDemand::Share { percent: Some(Percent(20)), mem: Some(MiB(1024)) }]));
    let record = ClaimRecord::of(&c);
    assert_eq!(record.key, ("t".to_owned(), "c".to_owned()));
    assert_eq!((record.version, record.allocated), (7, false));
}

#[test]
fn what_nano_gpu_does_not_allocate_is_refused_with_the_reason() {
    let cases = [
        (exactly(json!({"selectors": [{"cel": {"expression": "true"}}]})), "nano-gpu/gpu-model"),
        (
            exactly(
                json!({"selectors": [{"cel": {"expression": "device.attributes[\"gpu.nano-gpu.io\"].model != \"T4\""}}]}),
            ),
            "is not one nano-gpu allocates",
        ),
        (exactly(json!({"allocationMode": "All"})), "allocation mode All"),
        (exactly(json!({"count": 2, "capacity": {"requests": {"percent": "50"}}})), "count 1"),
        (exactly(json!({"count": 0})), "count 0"),
        (exactly(json!({"capacity": {"requests": {"percent": "0"}}})), "percent 0: 1 to 100"),
        (exactly(json!({"capacity": {"requests": {"percent": "101"}}})), "percent 101"),
        (exactly(json!({"capacity": {"requests": {"percent": "0.5"}}})), "percent \"0.5\""),
        (exactly(json!({"capacity": {"requests": {"cores": "1"}}})), "capacity \"cores\""),
        (exactly(json!({"adminAccess": true})), "admin access"),
        (
            json!([{"name": "gpu", "firstAvailable": [{"name": "a", "deviceClassName": CLASS}]}]),
            "firstAvailable",
        ),
        (
            json!([{"name": "a", "exactly": {"deviceClassName": CLASS}},
                   {"name": "b", "exactly": {"deviceClassName": "other.example.com"}}]),
            "mixes",
        ),
    ];
    for (requests, want) in cases {
        let err = slots(&claim(requests.clone())).unwrap_err();
        assert!(err.contains(want), "{requests}: {err}");
    }
    let mut c = claim(exactly(json!({})));
    c.spec.devices.as_mut().unwrap().config =
        Some(vec![serde_json::from_value(json!({"opaque": {"driver": DRIVER, "parameters": {}}})).unwrap()]);
    assert!(slots(&c).unwrap_err().contains("opaque"));
    let other = claim(json!([{"name": "x", "exactly": {"deviceClassName": "other.example.com"}}]));
    assert_eq!(ClaimRecord::of(&other).class, Class::Other);
}

#[test]
fn an_allocation_is_read_back_as_what_it_holds() {
    let given = [
        Given { request: "gpu".into(), card: 1, percent: Percent(30), memory: None },
        Given { request: "gpu".into(), card: 2, percent: Percent(100), memory: Some(MiB(2048)) },
    ];
    let mut c = claim(exactly(json!({})));
    let status = json!({"allocation": allocation("u-1", "node-2", &given)});
    c.status = Some(serde_json::from_value(status.clone()).unwrap());
    let record = ClaimRecord::of(&c);
    assert!(record.allocated);
    let held = record.held.unwrap();
    assert_eq!(held.node, "node-2");
    assert!(held.other_pools.is_empty());
    assert_eq!(
        held.devices,
        vec![
            HeldDevice { card: Ok(1), percent: Percent(30), memory: None },
            HeldDevice { card: Ok(2), percent: Percent(100), memory: Some(MiB(2048)) },
        ]
    );
    let results = &status["allocation"]["devices"]["results"];
    assert_eq!(results[0]["device"], "gpu-1");
    assert_eq!(results[0]["consumedCapacity"], json!({"percent": "30"}));
    assert_eq!(results[1]["consumedCapacity"], json!({"percent": "100", "memory": "2048Mi"}));
    // Share IDs: UUIDs, distinct per result, the same for a retried write.
    let (a, b) = (results[0]["shareID"].as_str().unwrap(), results[1]["shareID"].as_str().unwrap());
    assert_ne!(a, b);
    assert_eq!(a, share_id("u-1", 0));
    assert_eq!(a.len(), 36);
    assert_eq!(&a[14..15], "4");
    assert!(a.split('-').map(str::len).eq([8, 4, 4, 4, 12]));
    assert_eq!(
        status["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"],
        json!(["node-2"])
    );
}

#[test]
fn an_allocation_on_unknown_devices_or_several_pools_says_so() {
    let mut c = claim(exactly(json!({})));
    let result = |pool: &str, device: &str| json!({"request": "gpu", "driver": DRIVER, "pool": pool, "device": device});
    let other = json!({"request": "gpu", "driver": "other.example.com", "pool": "node-9", "device": "x"});
    c.status = Some(
        serde_json::from_value(json!({"allocation": {"devices": {"results": [
            result("node-1", "gpu-0"), result("node-1", "card-7"), result("node-3", "gpu-1"), other
        ]}}}))
        .unwrap(),
    );
    let held = ClaimRecord::of(&c).held.unwrap();
    assert_eq!(held.node, "node-1");
    assert_eq!(held.devices[0], HeldDevice { card: Ok(0), percent: Percent::FULL, memory: None });
    assert_eq!(held.devices[1].card, Err("card-7".into()));
    assert_eq!(held.other_pools, vec!["node-3".to_owned()]);
}

#[test]
fn pods_name_their_claims_directly_or_through_their_status() {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "t"},
        "spec": {"containers": [], "resourceClaims": [
            {"name": "a", "resourceClaimName": "mine"},
            {"name": "b", "resourceClaimTemplateName": "tpl"},
            {"name": "c", "resourceClaimTemplateName": "tpl"},
        ]},
        "status": {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "p-b-x1"}]},
    }))
    .unwrap();
    let named = |name: Option<&str>, template: Option<&str>| PodClaim {
        name: name.map(str::to_owned),
        template: template.map(str::to_owned),
    };
    assert_eq!(
        pod_claims(&pod),
        vec![named(Some("mine"), None), named(Some("p-b-x1"), Some("tpl")), named(None, Some("tpl"))]
    );
}

#[test]
fn placement_checks_selector_affinity_taints_and_cordon() {
    let pod = |spec: Value| -> Pod {
        let mut s = json!({"containers": []});
        for (k, v) in spec.as_object().unwrap() {
            s[k] = v.clone();
        }
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": s})).unwrap()
    };
    let node = |labels: Value, taints: Value, cordoned: bool| NodeFacts {
        labels: serde_json::from_value(labels).unwrap(),
        taints: serde_json::from_value(taints).unwrap(),
        cordoned,
    };
    let plain = node(json!({"zone": "a", "rank": "5"}), json!([]), false);
    let tainted = node(json!({}), json!([{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]), false);
    let soft = node(json!({}), json!([{"key": "gpu", "effect": "PreferNoSchedule"}]), false);
    let cordoned = node(json!({}), json!([]), true);

    let free = Placement::of(&pod(json!({})));
    assert_eq!(free.allows("n", &plain), Ok(()));
    assert_eq!(free.allows("n", &soft), Ok(()));
    assert!(free.allows("n", &tainted).unwrap_err().contains("taint gpu"));
    assert_eq!(free.allows("n", &cordoned), Err("cordoned".into()));

    let tolerant =
        Placement::of(&pod(json!({"tolerations": [{"key": "gpu", "operator": "Equal", "value": "yes"}]})));
    assert_eq!(tolerant.allows("n", &tainted), Ok(()));
    let wrong_value = Placement::of(&pod(json!({"tolerations": [{"key": "gpu", "value": "no"}]})));
    assert!(wrong_value.allows("n", &tainted).is_err());
    let everything = Placement::of(&pod(json!({"tolerations": [{"operator": "Exists"}]})));
    assert_eq!(everything.allows("n", &tainted), Ok(()));
    assert_eq!(everything.allows("n", &cordoned), Ok(()));

    let selector = Placement::of(&pod(json!({"nodeSelector": {"zone": "b"}})));
    assert!(selector.allows("n", &plain).unwrap_err().contains("zone=b"));
    let affinity = |exprs: Value| {
        let required = json!({"nodeSelectorTerms": [{"matchExpressions": exprs}]});
        Placement::of(&pod(
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}),
        ))
    };
    let zone_in = affinity(json!([{"key": "zone", "operator": "In", "values": ["a", "c"]}]));
    assert_eq!(zone_in.allows("n", &plain), Ok(()));
    assert!(
        affinity(json!([{"key": "zone", "operator": "NotIn", "values": ["a"]}])).allows("n", &plain).is_err()
    );
    assert_eq!(
        affinity(json!([{"key": "rank", "operator": "Gt", "values": ["4"]}])).allows("n", &plain),
        Ok(())
    );
    assert!(
        affinity(json!([{"key": "rank", "operator": "Lt", "values": ["4"]}])).allows("n", &plain).is_err()
    );
    assert!(affinity(json!([{"key": "gpu", "operator": "Exists"}])).allows("n", &plain).is_err());
    assert_eq!(affinity(json!([{"key": "gpu", "operator": "DoesNotExist"}])).allows("n", &plain), Ok(()));
    let required = json!({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]});
    let by_name = Placement::of(&pod(
        json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}),
    ));
    assert!(by_name.allows("n", &plain).is_err());
    assert_eq!(by_name.allows("n2", &plain), Ok(()));
}

#[test]
fn model_selectors_of_the_one_form_choose_models() {
    let one = |e: &str| selected_models(e);
    assert_eq!(
        one(r#"device.attributes["gpu.nano-gpu.io"].model == "Tesla T4""#),
        Some(vec!["Tesla T4".into()])
    );
    assert_eq!(
        one(
            r#"device.attributes['gpu.nano-gpu.io'].model=='A100' || device.attributes["gpu.nano-gpu.io"].model == "H100""#
        ),
        Some(vec!["A100".into(), "H100".into()])
    );
    for other in [
        "true",
        r#"device.attributes["gpu.nano-gpu.io"].model == "A" && true"#,
        r#"device.attributes["gpu.nano-gpu.io"].uuid == "A""#,
        r#"device.attributes["other.io"].model == "A""#,
        r#"device.attributes["gpu.nano-gpu.io"].model == """#,
        r#"device.attributes["gpu.nano-gpu.io"].model == "A" || true"#,
        r#"device.attributes["gpu.nano-gpu.io"].model == "a"b""#,
    ] {
        assert_eq!(one(other), None, "{other}");
    }
    // Two selectors: both hold.
    let selector = |models: &str| json!({"cel": {"expression": models}});
    let c = claim(exactly(json!({"selectors": [
        selector(r#"device.attributes["gpu.nano-gpu.io"].model == "A" || device.attributes["gpu.nano-gpu.io"].model == "B""#),
        selector(r#"device.attributes["gpu.nano-gpu.io"].model == "B""#),
    ]})));
    let Class::Ours(Ok(slots)) = ClaimRecord::of(&c).class else { panic!() };
    assert_eq!(slots[0].models, Some(vec!["B".to_owned()]));
}

#[test]
fn template_names_stand_for_their_slot_and_the_template_asks_exactly_it() {
    let slots = [
        SlotDemand::Share { percent: Some(Percent(30)), mem: None },
        SlotDemand::Share { percent: Some(Percent(5)), mem: Some(MiB(4096)) },
        SlotDemand::Share { percent: None, mem: Some(MiB(2048)) },
        SlotDemand::Whole { cards: 2, mem: None },
        SlotDemand::Whole { cards: 1, mem: Some(MiB(16384)) },
    ];
    let names: Vec<String> = slots.iter().map(template_name).collect();
    assert_eq!(
        names,
        ["nano-gpu-p30", "nano-gpu-p5-m4096", "nano-gpu-m2048", "nano-gpu-w2", "nano-gpu-w1-m16384"]
    );
    for (slot, name) in slots.iter().zip(&names) {
        assert_eq!(template_shape(name), Some(*slot), "{name}");
        // The claim the ResourceClaim controller makes from the template asks the same slot.
        let t = template("t", name).unwrap();
        assert_eq!(t["metadata"]["namespace"], "t");
        let made: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "x", "namespace": "t"}, "spec": t["spec"]["spec"],
        }))
        .unwrap();
        assert_eq!(slots_of(&made), Ok(vec![*slot]), "{name}");
    }
    for bad in [
        "nano-gpu-p0",
        "nano-gpu-p100",
        "nano-gpu-p030",
        "nano-gpu-w0",
        "nano-gpu-w65",
        "nano-gpu-m0",
        "nano-gpu-m1-m2",
        "nano-gpu-x1",
        "nano-gpu-p30-m",
        "other-p30",
        "nano-gpu-p30-m01",
    ] {
        assert_eq!(template_shape(bad), None, "{bad}");
        assert!(template("t", bad).is_none());
    }
}

fn slots_of(c: &ResourceClaim) -> Result<Vec<SlotDemand>, String> {
    slots(c)
}

#[test]
fn a_memory_selector_of_the_one_form_asks_whole_cards_that_have_that_much() {
    let least = |e: &str| least_card_memory(e);
    assert_eq!(
        least(r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40Gi")) >= 0"#),
        Some(MiB(40960))
    );
    assert_eq!(
        least(r#"device.capacity['gpu.nano-gpu.io'].memory.compareTo(quantity('40Gi'))>0"#),
        Some(MiB(40961))
    );
    // A quantity between whole MiB: the next MiB up, whether it must be more or at least as much.
    assert_eq!(
        least(r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40G")) >= 0"#),
        Some(MiB(38147))
    );
    assert_eq!(
        least(r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40G")) > 0"#),
        Some(MiB(38147))
    );
    for other in [
        r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40Gi")) <= 0"#,
        r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40Gi")) >= 1"#,
        r#"device.capacity["gpu.nano-gpu.io"].percent.compareTo(quantity("40")) >= 0"#,
        r#"device.capacity["other.io"].memory.compareTo(quantity("40Gi")) >= 0"#,
        r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("lots")) >= 0"#,
        r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40Gi')) >= 0"#,
        r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("40Gi")) >= 0 || true"#,
    ] {
        assert_eq!(least(other), None, "{other}");
    }
    let selector = |e: &str| json!({"cel": {"expression": e}});
    let at_least = |q: &str| {
        selector(&format!(r#"device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("{q}")) >= 0"#))
    };
    // Whole cards: each must have that much (the highest of several selectors and of asked memory),
    // beside a model selector; the allocation asks no memory of its own.
    let c = claim(exactly(json!({"count": 2, "selectors": [
        at_least("40Gi"), at_least("80Gi"),
        selector(r#"device.attributes["gpu.nano-gpu.io"].model == "A100""#),
    ]})));
    let Class::Ours(Ok(read)) = ClaimRecord::of(&c).class else { panic!() };
    assert_eq!(read[0].demand, SlotDemand::Whole { cards: 2, mem: Some(MiB(81920)) });
    assert_eq!((read[0].models.clone(), read[0].memory_asked), (Some(vec!["A100".to_owned()]), false));
    let c = claim(exactly(
        json!({"capacity": {"requests": {"percent": "100", "memory": "90Gi"}}, "selectors": [at_least("80Gi")]}),
    ));
    assert_eq!(slots(&c), Ok(vec![SlotDemand::Whole { cards: 1, mem: Some(MiB(92160)) }]));
    // A share: refused with the reason.
    let c =
        claim(exactly(json!({"capacity": {"requests": {"percent": "30"}}, "selectors": [at_least("40Gi")]})));
    let why = slots(&c).unwrap_err();
    assert!(why.contains("read for whole cards only") && why.contains("capacity (memory)"), "{why}");
}
