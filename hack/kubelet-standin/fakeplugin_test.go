package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

const fooResource = "example.com/foo"

// fakePlugin is the upstream device-plugin test stub serving 4 devices of
// example.com/foo; Allocate answers FOO_DEVICES=<sorted ids> and one device
// spec per ID, or fails while failAllocate is set.
type fakePlugin struct {
	stub         *plugin.Stub
	allocations  atomic.Int32
	failAllocate atomic.Bool
}

func startFakePlugin(t *testing.T, ctx context.Context, root string, fp *fakePlugin) {
	t.Helper()
	var devs []*pluginapi.Device
	for i := 0; i < 4; i++ {
		devs = append(devs, &pluginapi.Device{ID: fmt.Sprintf("foo-%d", i), Health: pluginapi.Healthy})
	}
	dir := filepath.Join(root, "device-plugins")
	fp.stub = plugin.NewDevicePluginStub(klog.FromContext(ctx), devs, filepath.Join(dir, "foo.sock"), fooResource, true, true)
	fp.stub.SetAllocFunc(func(r *pluginapi.AllocateRequest, _ map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error) {
		fp.allocations.Add(1)
		if fp.failAllocate.Load() {
			return nil, errors.New("boom from the fake plugin")
		}
		resp := &pluginapi.AllocateResponse{}
		for _, cr := range r.ContainerRequests {
			ids := append([]string(nil), cr.DevicesIds...)
			sort.Strings(ids)
			car := &pluginapi.ContainerAllocateResponse{Envs: map[string]string{"FOO_DEVICES": strings.Join(ids, ",")}}
			for _, id := range ids {
				car.Devices = append(car.Devices, &pluginapi.DeviceSpec{ContainerPath: "/dev/" + id, HostPath: "/dev/null", Permissions: "rw"})
			}
			resp.ContainerResponses = append(resp.ContainerResponses, car)
		}
		return resp, nil
	})
	if err := fp.stub.Start(ctx); err != nil {
		t.Fatalf("starting fake plugin: %v", err)
	}
	if err := fp.stub.Register(ctx, filepath.Join(dir, "kubelet.sock"), fooResource, ""); err != nil {
		t.Fatalf("registering fake plugin: %v", err)
	}
	t.Cleanup(func() { _ = fp.stub.Stop(klog.FromContext(ctx)) })
}

func eventually(t *testing.T, what string, f func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ok, detail := f()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %s", what, detail)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func readState(t *testing.T, path string) stateFile {
	t.Helper()
	var st stateFile
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading state file: %v", err)
	}
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatalf("state file: %v", err)
	}
	return st
}

func fooPod(name string, initFoo, appFoo int64) *v1.Pod {
	res := func(n int64) v1.ResourceRequirements {
		if n == 0 {
			return v1.ResourceRequirements{}
		}
		q := *resource.NewQuantity(n, resource.DecimalSI)
		return v1.ResourceRequirements{Limits: v1.ResourceList{fooResource: q}, Requests: v1.ResourceList{fooResource: q}}
	}
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)},
		Spec: v1.PodSpec{
			NodeName:   "n1",
			Containers: []v1.Container{{Name: "c", Image: "pause", Resources: res(appFoo)}},
		},
		Status: v1.PodStatus{Phase: v1.PodPending},
	}
	if initFoo > 0 {
		p.Spec.InitContainers = []v1.Container{{Name: "init", Image: "pause", Resources: res(initFoo)}}
	}
	return p
}

// standinRun runs the stand-in until the returned stop func is called.
func standinRun(t *testing.T, root string, client kubernetes.Interface) (stop func()) {
	t.Helper()
	cfg := config{
		nodeName: "n1", rootDir: root, stateFile: filepath.Join(root, "standin-state.json"), nodeIP: "127.0.0.1",
		capacity: nodeCapacity{
			cpu: resource.MustParse("16"), memory: resource.MustParse("64Gi"),
			pods: resource.MustParse("110"), ephemeralStorage: resource.MustParse("100Gi"),
		},
		heartbeat: time.Second, capacityPoll: 100 * time.Millisecond, resync: 200 * time.Millisecond, startRetry: time.Second,
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, cfg, client) }()
	eventually(t, "kubelet.sock", func() (bool, string) {
		_, err := os.Stat(filepath.Join(root, "device-plugins", "kubelet.sock"))
		return err == nil, fmt.Sprint(err)
	})
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("run did not stop")
		}
	}
	t.Cleanup(stop)
	return stop
}

func TestStandinAgainstFakePlugin(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	statePath := filepath.Join(root, "standin-state.json")
	client := fake.NewClientset()
	pods := client.CoreV1().Pods("default")

	stop := standinRun(t, root, client)
	fp := &fakePlugin{}
	startFakePlugin(t, ctx, root, fp)

	waitCapacity := func(want int64) {
		eventually(t, fmt.Sprintf("node capacity %s=%d", fooResource, want), func() (bool, string) {
			n, err := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			c, a := n.Status.Capacity[fooResource], n.Status.Allocatable[fooResource]
			ready := false
			for _, cond := range n.Status.Conditions {
				ready = ready || (cond.Type == v1.NodeReady && cond.Status == v1.ConditionTrue)
			}
			cpu := n.Status.Capacity[v1.ResourceCPU]
			return c.Value() == want && a.Value() == want && ready && cpu.Value() == 16 && n.Labels[v1.LabelHostname] == "n1",
				fmt.Sprintf("capacity %v, allocatable %v, ready %v", n.Status.Capacity, n.Status.Allocatable, ready)
		})
	}
	waitCapacity(4)

	waitPod := func(name string, phase string) podState {
		var ps *podState
		eventually(t, name+" "+phase, func() (bool, string) {
			ps = readState(t, statePath).Pods["default/"+name]
			if ps == nil || ps.Phase != phase {
				return false, fmt.Sprintf("%+v", ps)
			}
			p, err := pods.Get(ctx, name, metav1.GetOptions{})
			return err == nil && string(p.Status.Phase) == phase, fmt.Sprintf("api status %+v", p.Status)
		})
		return *ps
	}
	checkDevices := func(name, container string, ps podState, n int) []string {
		t.Helper()
		c := ps.Containers[container]
		if c == nil {
			t.Fatalf("%s: no container %q in state: %+v", name, container, ps)
		}
		ids := c.Devices[fooResource]
		if len(ids) != n || c.Env["FOO_DEVICES"] != strings.Join(ids, ",") || len(c.DeviceSpecs) != n {
			t.Fatalf("%s/%s: devices %v, env %v, specs %v", name, container, ids, c.Env, c.DeviceSpecs)
		}
		return ids
	}

	// Admitted: devices, env and device specs recorded.
	if _, err := pods.Create(ctx, fooPod("p1", 0, 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p1 := checkDevices("p1", "c", waitPod("p1", "Running"), 2)

	// The pod-resources List reports the same devices.
	conn, err := grpc.NewClient("unix://"+filepath.Join(root, "pod-resources", "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	listed := func() string {
		list, err := podresourcesv1.NewPodResourcesListerClient(conn).List(ctx, &podresourcesv1.ListPodResourcesRequest{})
		if err != nil {
			return "List: " + err.Error()
		}
		var out []string
		for _, pr := range list.PodResources {
			for _, c := range pr.Containers {
				for _, d := range c.Devices {
					out = append(out, fmt.Sprintf("%s/%s/%s=%s", pr.Namespace, pr.Name, c.Name, strings.Join(d.DeviceIds, ",")))
				}
			}
		}
		sort.Strings(out)
		return strings.Join(out, " ")
	}
	want := func(name string, ids []string) string {
		var out []string
		for _, id := range ids {
			out = append(out, "default/"+name+"/c="+id)
		}
		return strings.Join(out, " ")
	}
	if got := listed(); got != want("p1", p1) {
		t.Fatalf("pod-resources List: got %v, want %v", got, want("p1", p1))
	}

	// More than available: rejected by the device manager.
	if _, err := pods.Create(ctx, fooPod("p2", 0, 3), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p2 := waitPod("p2", "Failed")
	if p2.Reason != "UnexpectedAdmissionError" || !strings.Contains(p2.Message, "Requested: 3, Available: 2") {
		t.Fatalf("p2: %+v", p2)
	}
	// The plugin's Allocate error reaches the pod status message.
	fp.failAllocate.Store(true)
	if _, err := pods.Create(ctx, fooPod("p3", 0, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p3 := waitPod("p3", "Failed")
	fp.failAllocate.Store(false)
	if p3.Reason != "UnexpectedAdmissionError" || !strings.Contains(p3.Message, "boom from the fake plugin") {
		t.Fatalf("p3: %+v", p3)
	}

	// Deleting p1 frees its devices.
	if err := pods.Delete(ctx, "p1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "p1 dropped from the state", func() (bool, string) {
		_, ok := readState(t, statePath).Pods["default/p1"]
		return !ok, ""
	})
	if _, err := pods.Create(ctx, fooPod("p4", 0, 4), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p4 := checkDevices("p4", "c", waitPod("p4", "Running"), 4)

	// Restart: checkpoint and state survive, nothing is re-allocated.
	restart := func(name string, ids []string) {
		t.Helper()
		stop()
		_ = fp.stub.Stop(klog.FromContext(ctx))
		allocs := fp.allocations.Load()
		stop = standinRun(t, root, client)
		// Until the plugin re-registers the resource is known (checkpoint)
		// but has no devices, so its capacity is 0, as after a kubelet restart.
		waitCapacity(0)
		eventually(t, name+" re-admitted from the checkpoint", func() (bool, string) {
			got := listed()
			return got == want(name, ids), got
		})
		fp = &fakePlugin{}
		fp.allocations.Store(allocs)
		startFakePlugin(t, ctx, root, fp) // the device manager removed the old socket
		waitCapacity(4)
		if n := fp.allocations.Load(); n != allocs {
			t.Fatalf("allocations after restart: %d, before %d", n, allocs)
		}
	}
	restart("p4", p4)
	if got := checkDevices("p4", "c", waitPod("p4", "Running"), 4); strings.Join(got, ",") != strings.Join(p4, ",") {
		t.Fatalf("p4 after restart: %v, before %v", got, p4)
	}
	// p4 still holds all 4 devices according to the reloaded checkpoint.
	if _, err := pods.Create(ctx, fooPod("p5", 0, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if p5 := waitPod("p5", "Failed"); !strings.Contains(p5.Message, "Requested: 1, Available: 0") {
		t.Fatalf("p5: %+v", p5)
	}

	// Init container devices are reused by the app container, as in the kubelet.
	if err := pods.Delete(ctx, "p4", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Create(ctx, fooPod("p6", 2, 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p6 := waitPod("p6", "Running")
	initIDs, appIDs := checkDevices("p6", "init", p6, 2), checkDevices("p6", "c", p6, 2)
	if strings.Join(initIDs, ",") != strings.Join(appIDs, ",") || !p6.Containers["init"].Init {
		t.Fatalf("p6: init %v, app %v", initIDs, appIDs)
	}
	// ... and such a pod survives a restart (see the deviation in standin.go).
	restart("p6", appIDs)
	if got := waitPod("p6", "Running"); !reflect.DeepEqual(got, p6) {
		t.Fatalf("p6 after restart: %+v, before %+v", got, p6)
	}
}
