// Command kubelet-standin plays the kubelet's device-manager side for ONE
// simulated node in local end-to-end tests, where there are no real kubelets
// and no containers. Test harness only (see hack/k8s-build.sh, which builds
// it next to the pinned upstream binaries); product logic lives in Rust.
//
// It drives the real upstream kubelet code of the pinned Kubernetes version:
// the device manager (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager) behind
// a "none"-policy topology manager as the kubelet's allocate admit handler,
// the kubelet's predicate admit handler (lifecycle.NewPredicateAdmitHandler),
// the pod-resources v1 and v1alpha1 gRPC servers
// (k8s.io/kubernetes/pkg/kubelet/apis/podresources) and the node lease
// controller. What is simulated is the rest of the kubelet: pod manager,
// status manager, container runtime (containers "start" instantly and run
// forever) and node status.
//
// Flags:
//
//	--kubeconfig PATH         kubeconfig to reach the apiserver (required)
//	--node-name NAME          the Node this process plays (required)
//	--root-dir DIR            kubelet root dir (required); uses
//	                          DIR/device-plugins/kubelet.sock (registration,
//	                          plus the device manager's checkpoint file
//	                          kubelet_internal_checkpoint) and
//	                          DIR/pod-resources/kubelet.sock (pod-resources)
//	--cpu QTY                 node cpu capacity (default "16")
//	--memory QTY              node memory capacity (default "64Gi")
//	--pods N                  node pods capacity (default "110")
//	--ephemeral-storage QTY   node ephemeral-storage capacity (default "100Gi")
//	--node-ip IP              InternalIP of the Node and hostIP of its pods
//	                          (default "127.0.0.1")
//	--state-file PATH         facts recorded for tests (default
//	                          DIR/standin-state.json)
//	-v N                      klog verbosity (logs go to stderr)
//
// Behaviour: registers/updates the Node (labels kubernetes.io/hostname, os,
// arch; never touches other labels or annotations; status only through
// status-subresource strategic-merge patches), keeps its Ready condition and
// Lease fresh (every 10 s) and republishes capacity/allocatable within ~1 s
// of a device-manager capacity change. Pods bound to the node are admitted
// one at a time like kubelet HandlePodAdditions (creation order; the pod is
// in the pod-resources List from the start of its admission). A rejected pod
// gets phase Failed, the admit handler's reason (UnexpectedAdmissionError for
// device allocation errors) and message "Pod was rejected: <message>", as
// the kubelet writes it. An admitted pod's containers are "started" in
// kubelet order (init containers first) through GetDeviceRunContainerOptions
// (which calls PreStartContainer when the plugin asks for it), then the pod
// is marked Running and Ready. If a container cannot start (e.g.
// PreStartContainer fails) the pod stays Pending with the container waiting
// in CreateContainerConfigError and the start is retried every 5 s. A pod
// with a deletionTimestamp is dropped at once and deleted with grace period
// 0; Succeeded/Failed pods stop counting as active, so the device manager
// frees their devices on its next allocation, as in the kubelet.
//
// Restart (even after SIGKILL) with the same root dir resumes: the device
// manager reloads its checkpoint, the state file is the "container runtime"
// record of which containers run, so pods it lists as Running are re-admitted
// the way a restarted kubelet does (sources not ready yet, containers known
// running: no new allocation) and keep their recorded facts. Deviation: their
// completed init containers count as running too, so a pod whose init
// container used devices is not rejected (the kubelet does reject it,
// upstream bug kubernetes/kubernetes#124345 / #138446). Plugins must
// re-register: like the kubelet, the device manager removes every socket in
// DIR/device-plugins and re-creates kubelet.sock. SIGTERM/SIGINT exit 0.
//
// State file: JSON, rewritten atomically (tmp + rename) after every change:
//
//	{
//	  "node": "n1",
//	  "pods": {
//	    "<namespace>/<name>": {
//	      "uid": "…",
//	      "phase": "Running",            // Running | Failed | Pending | Succeeded
//	      "reason": "…",                 // Failed: pod status reason (e.g. UnexpectedAdmissionError);
//	                                     // Pending: CreateContainerConfigError
//	      "message": "…",                // Failed: pod status message; Pending: the start error
//	      "containers": {                // init and app containers that started
//	        "<container>": {
//	          "init": true,              // only for init containers
//	          "env": {"NVIDIA_VISIBLE_DEVICES": "…"},
//	          "devices": {"nano-gpu/gpu-percent": ["<uuid>-00", …]},  // sorted
//	          "deviceSpecs": [{"containerPath": "…", "hostPath": "…", "permissions": "rw"}],
//	          "mounts": [{"containerPath": "…", "hostPath": "…", "readOnly": true}],
//	          "annotations": {"…": "…"},
//	          "cdiDevices": ["vendor.com/class=name"]
//	        }
//	      }
//	    }
//	  }
//	}
//
// env, devices and deviceSpecs are always present for a started container
// (possibly empty); mounts, annotations and cdiDevices only when the plugin
// returned any. Terminal pods keep the containers they had.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// config is everything run needs besides the API client.
type config struct {
	nodeName  string
	rootDir   string
	stateFile string
	nodeIP    string
	capacity  nodeCapacity
	// Intervals; tests shorten them.
	heartbeat    time.Duration // Ready condition refresh and lease renewal
	capacityPoll time.Duration // device-manager capacity check
	resync       time.Duration // pod sync without informer events (retries)
	startRetry   time.Duration // retry of a pod whose containers failed to start
}

type nodeCapacity struct {
	cpu, memory, pods, ephemeralStorage resource.Quantity
}

func main() {
	klog.InitFlags(nil)
	var (
		kubeconfig = flag.String("kubeconfig", "", "kubeconfig to reach the apiserver (required)")
		nodeName   = flag.String("node-name", "", "name of the Node this process plays (required)")
		rootDir    = flag.String("root-dir", "", "kubelet root dir for device-plugins/ and pod-resources/ (required)")
		cpu        = flag.String("cpu", "16", "node cpu capacity")
		memory     = flag.String("memory", "64Gi", "node memory capacity")
		pods       = flag.String("pods", "110", "node pods capacity")
		ephemeral  = flag.String("ephemeral-storage", "100Gi", "node ephemeral-storage capacity")
		nodeIP     = flag.String("node-ip", "127.0.0.1", "InternalIP of the Node and hostIP of its pods")
		stateFile  = flag.String("state-file", "", "state file for tests (default <root-dir>/standin-state.json)")
	)
	flag.Parse()
	if *kubeconfig == "" || *nodeName == "" || *rootDir == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: kubelet-standin --kubeconfig PATH --node-name NAME --root-dir DIR [flags]")
		flag.PrintDefaults()
		os.Exit(2)
	}
	root, err := filepath.Abs(*rootDir)
	if err != nil {
		klog.Fatalf("root dir: %v", err)
	}
	cfg := config{
		nodeName:     *nodeName,
		rootDir:      root,
		stateFile:    *stateFile,
		nodeIP:       *nodeIP,
		heartbeat:    10 * time.Second,
		capacityPoll: time.Second,
		resync:       2 * time.Second,
		startRetry:   5 * time.Second,
	}
	if cfg.stateFile == "" {
		cfg.stateFile = filepath.Join(root, "standin-state.json")
	}
	for _, q := range []struct {
		flag, value string
		into        *resource.Quantity
	}{
		{"cpu", *cpu, &cfg.capacity.cpu},
		{"memory", *memory, &cfg.capacity.memory},
		{"pods", *pods, &cfg.capacity.pods},
		{"ephemeral-storage", *ephemeral, &cfg.capacity.ephemeralStorage},
	} {
		if *q.into, err = resource.ParseQuantity(q.value); err != nil {
			klog.Fatalf("--%s: %v", q.flag, err)
		}
	}

	restCfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		klog.Fatalf("kubeconfig: %v", err)
	}
	restCfg.UserAgent = "kubelet-standin/" + cfg.nodeName
	restCfg.QPS, restCfg.Burst = 50, 100 // kubelet defaults (kubeAPIQPS/kubeAPIBurst)
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		klog.Fatalf("client: %v", err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, cfg, client); err != nil && ctx.Err() == nil {
		klog.ErrorS(err, "kubelet-standin failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.InfoS("kubelet-standin stopped", "node", cfg.nodeName)
	klog.Flush()
}
