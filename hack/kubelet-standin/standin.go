package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/component-helpers/apimachinery/lease"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
	kubeletutil "k8s.io/kubernetes/pkg/kubelet/util"
	"k8s.io/utils/clock"
)

// standin is one simulated kubelet.
type standin struct {
	cfg    config
	client kubernetes.Interface
	logger klog.Logger

	dm      *devicemanager.ManagerImpl
	admit   []lifecycle.PodAdmitHandler // kubelet order: allocate (topology manager), then predicates
	sources *sourcesReady
	pods    *podManager
	state   *state
	// Pods the "container runtime" (the state file) reports running at
	// startup: re-admitted without new allocations, not restarted.
	runningAtStart sets.Set[types.UID]

	podLister  corelisters.PodLister
	nodeLister corelisters.NodeLister
	kick       chan struct{}

	arrivalMu sync.Mutex
	arrivals  map[types.UID]uint64 // order in which pods were first seen
	arrivalN  uint64

	// Worker-goroutine only.
	deleting map[types.UID]time.Time // last forced delete per pod
	retries  map[types.UID]*retry
}

// sourcesReady is the kubelet's config.SourcesReady: false until the pods
// already bound to the node have all been seen and re-admitted once. Until
// then the device manager neither garbage-collects checkpointed allocations
// nor re-allocates containers the runtime reports running.
type sourcesReady struct{ ready atomic.Bool }

func (s *sourcesReady) AddSource(string) {}
func (s *sourcesReady) AllReady() bool   { return s.ready.Load() }

func run(ctx context.Context, cfg config, client kubernetes.Interface) error {
	logger := klog.FromContext(ctx).WithValues("node", cfg.nodeName)
	ctx = klog.NewContext(ctx, logger)
	pluginDir := filepath.Join(cfg.rootDir, "device-plugins")
	for _, d := range []string{cfg.rootDir, pluginDir, filepath.Join(cfg.rootDir, "pod-resources")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}

	st, err := loadState(cfg.stateFile, cfg.nodeName)
	if err != nil {
		return err
	}
	s := &standin{
		cfg: cfg, client: client, logger: logger,
		sources:  &sourcesReady{},
		pods:     newPodManager(),
		state:    st,
		kick:     make(chan struct{}, 1),
		arrivals: map[types.UID]uint64{},
		deleting: map[types.UID]time.Time{},
		retries:  map[types.UID]*retry{},
	}

	// Container manager, as pkg/kubelet/cm/container_manager_linux.go wires
	// it with --topology-manager-policy=none (the default).
	tm, err := topologymanager.NewManager(nil, topologymanager.PolicyNone, "container", nil)
	if err != nil {
		return fmt.Errorf("topology manager: %w", err)
	}
	s.dm, err = newDeviceManager(logger, filepath.Join(pluginDir, "kubelet.sock"), nil, tm)
	if err != nil {
		return fmt.Errorf("device manager: %w", err)
	}
	tm.AddHintProvider(logger, s.dm)
	// Like kubelet reconcileExtendedResource: no checkpoint means a new node.
	resetExtended := s.dm.ShouldResetExtendedResourceCapacity()

	// The "runtime": containers of pods the state file lists as Running.
	// Deviation: completed init containers are reported running too. With
	// only the really running ones, the upstream device manager rejects a
	// running pod whose init container used devices when the kubelet
	// restarts before the plugin re-registered (upstream bug
	// kubernetes/kubernetes#124345, still reported open as #138446); here
	// running pods must survive a restart.
	containers, runningIDs := containermap.NewContainerMap(), sets.New[string]()
	s.runningAtStart = sets.New[types.UID]()
	for _, p := range st.data.Pods {
		if p.Phase != string(v1.PodRunning) {
			continue
		}
		s.runningAtStart.Insert(types.UID(p.UID))
		for name := range p.Containers {
			id := containerID(types.UID(p.UID), name)
			containers.Add(p.UID, name, id)
			runningIDs.Insert(id)
		}
	}
	if err := s.dm.Start(logger, s.activePods, s.sources, containers, runningIDs); err != nil {
		return fmt.Errorf("device manager start: %w", err)
	}
	defer func() {
		if err := s.dm.Stop(logger); err != nil {
			logger.Error(err, "Stopping device manager")
		}
	}()
	logger.Info("Device manager started", "socket", filepath.Join(pluginDir, "kubelet.sock"))
	go func() { // health updates (ResourceHealthStatus, alpha): nothing to do
		for {
			select {
			case <-ctx.Done():
				return
			case u := <-s.dm.Updates():
				logger.V(2).Info("Device health update", "pods", u.PodUIDs)
			}
		}
	}()

	prServer, err := s.servePodResources(ctx)
	if err != nil {
		return err
	}
	defer prServer.Stop()

	// Informers for our pods and our Node.
	podFactory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", cfg.nodeName).String()
	}))
	nodeFactory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", cfg.nodeName).String()
	}))
	podInformer := podFactory.Core().V1().Pods()
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(obj) },
		UpdateFunc: func(_, obj any) { s.observe(obj) },
		DeleteFunc: func(any) { s.poke() },
	}); err != nil {
		return err
	}
	s.podLister = podInformer.Lister()
	s.nodeLister = nodeFactory.Core().V1().Nodes().Lister()

	s.admit = []lifecycle.PodAdmitHandler{
		tm, // cm.GetAllocateResourcesPodAdmitHandler()
		lifecycle.NewPredicateAdmitHandler(s.getNode, lifecycle.NewAdmissionFailureHandlerStub(), s.dm.UpdatePluginResources),
	}

	if err := s.registerNode(ctx, resetExtended); err != nil {
		return err
	}
	podFactory.Start(ctx.Done())
	nodeFactory.Start(ctx.Done())
	defer podFactory.Shutdown()
	defer nodeFactory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), podInformer.Informer().HasSynced, nodeFactory.Core().V1().Nodes().Informer().HasSynced) {
		return ctx.Err()
	}

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(2)
	go func() { defer wg.Done(); s.nodeStatusLoop(ctx) }()
	go func() {
		defer wg.Done()
		lease.NewController(clock.RealClock{}, client, cfg.nodeName, int32(4*cfg.heartbeat/time.Second), nil,
			cfg.heartbeat, cfg.nodeName, v1.NamespaceNodeLease,
			kubeletutil.SetNodeOwnerFunc(ctx, client, cfg.nodeName)).Run(ctx)
	}()

	s.podWorker(ctx)
	return nil
}

// activePods is the kubelet's GetActivePods: pods in the pod manager that are
// neither terminal nor known terminated. The device manager frees the
// devices of every pod not listed here on its next allocation.
func (s *standin) activePods() []*v1.Pod { return s.pods.active() }

// getNode is the kubelet's GetCachedNode for the predicate admit handler.
func (s *standin) getNode(ctx context.Context, useCache bool) (*v1.Node, error) {
	if useCache {
		if n, err := s.nodeLister.Get(s.cfg.nodeName); err == nil {
			return n, nil
		}
	}
	return s.client.CoreV1().Nodes().Get(ctx, s.cfg.nodeName, metav1.GetOptions{})
}

// observe notes the order pods arrive in and wakes the pod worker.
func (s *standin) observe(obj any) {
	if p, ok := obj.(*v1.Pod); ok {
		s.arrivalMu.Lock()
		if _, seen := s.arrivals[p.UID]; !seen {
			s.arrivalN++
			s.arrivals[p.UID] = s.arrivalN
		}
		s.arrivalMu.Unlock()
	}
	s.poke()
}

func (s *standin) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func (s *standin) arrival(uid types.UID) uint64 {
	s.arrivalMu.Lock()
	defer s.arrivalMu.Unlock()
	return s.arrivals[uid]
}

func (s *standin) forgetArrival(uid types.UID) {
	s.arrivalMu.Lock()
	defer s.arrivalMu.Unlock()
	delete(s.arrivals, uid)
}

// pruneArrivals forgets pods that are gone from the API.
func (s *standin) pruneArrivals(current map[types.UID]*v1.Pod) {
	s.arrivalMu.Lock()
	defer s.arrivalMu.Unlock()
	for uid := range s.arrivals {
		if _, ok := current[uid]; !ok {
			delete(s.arrivals, uid)
		}
	}
}

func containerID(uid types.UID, name string) string {
	return fmt.Sprintf("standin://%s/%s", uid, name)
}
