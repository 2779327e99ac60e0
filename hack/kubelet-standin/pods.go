package main

import (
	"context"
	"sort"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/klog/v2"
	podutil "k8s.io/kubernetes/pkg/api/v1/pod"
	"k8s.io/kubernetes/pkg/apis/core/v1/helper/qos"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
	statusutil "k8s.io/kubernetes/pkg/util/pod"
	"k8s.io/utils/ptr"
)

// podManager is the kubelet's pod manager plus the phase its status manager
// decided, shared with the pod-resources server.
type podManager struct {
	mu   sync.Mutex
	pods map[types.UID]*podRecord
}

type podRecord struct {
	pod   *v1.Pod     // latest object from the informer (read-only)
	phase v1.PodPhase // this kubelet's view: "" while admitting, Pending, Running, Failed, Succeeded
}

func newPodManager() *podManager { return &podManager{pods: map[types.UID]*podRecord{}} }

func (m *podManager) add(p *v1.Pod) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pods[p.UID] = &podRecord{pod: p}
}

// update stores the latest object of a known pod; false if unknown.
func (m *podManager) update(p *v1.Pod) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.pods[p.UID]
	if ok {
		r.pod = p
	}
	return ok
}

func (m *podManager) remove(uid types.UID) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.pods[uid]
	delete(m.pods, uid)
	return ok
}

func (m *podManager) get(uid types.UID) (*v1.Pod, v1.PodPhase, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.pods[uid]
	if !ok {
		return nil, "", false
	}
	return r.pod, r.phase, true
}

func (m *podManager) setPhase(uid types.UID, phase v1.PodPhase) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if r, ok := m.pods[uid]; ok {
		r.phase = phase
	}
}

func (m *podManager) uids() []types.UID {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]types.UID, 0, len(m.pods))
	for uid := range m.pods {
		out = append(out, uid)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// inactive is the kubelet's isPodInactive: terminal in the API or terminal
// for this kubelet (e.g. rejected at admission). Pods are known terminated
// here as soon as they are deleted, so those are never in the manager.
func (r *podRecord) inactive() bool {
	return podutil.IsPodPhaseTerminal(r.pod.Status.Phase) || podutil.IsPodPhaseTerminal(r.phase)
}

func (m *podManager) list(activeOnly bool) []*v1.Pod {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*v1.Pod, 0, len(m.pods))
	for _, r := range m.pods {
		if !activeOnly || !r.inactive() {
			out = append(out, r.pod)
		}
	}
	sort.Slice(out, func(i, j int) bool { return podKey(out[i]) < podKey(out[j]) })
	return out
}

func (m *podManager) active() []*v1.Pod { return m.list(true) }

func (m *podManager) activeByName(namespace, name string) (*v1.Pod, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range m.pods {
		if r.pod.Namespace == namespace && r.pod.Name == name && !r.inactive() {
			return r.pod, true
		}
	}
	return nil, false
}

// retry is pending work for one pod (pod worker only).
type retry struct {
	status  *v1.PodStatus // status still to publish
	startAt time.Time     // next container start attempt
}

func podKey(p *v1.Pod) string { return p.Namespace + "/" + p.Name }

// podWorker is the kubelet's sync loop, reduced to what matters here. The
// first pass handles the pods already bound to the node; only then are the
// sources ready (see sourcesReady).
func (s *standin) podWorker(ctx context.Context) {
	s.syncPods(ctx)
	s.sources.ready.Store(true)
	s.logger.Info("Initial pods handled, sources ready", "pods", len(s.pods.uids()))
	t := time.NewTicker(s.cfg.resync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.kick:
		case <-t.C:
		}
		s.syncPods(ctx)
	}
}

func (s *standin) syncPods(ctx context.Context) {
	apiPods, err := s.podLister.List(labels.Everything())
	if err != nil {
		s.logger.Error(err, "Listing pods")
		return
	}
	byUID := make(map[types.UID]*v1.Pod, len(apiPods))
	for _, p := range apiPods {
		if p.Spec.NodeName == s.cfg.nodeName {
			byUID[p.UID] = p
		}
	}

	// Deleted pods, and pods being deleted: there are no containers to stop,
	// so they are terminated at once and their devices become free.
	for _, uid := range s.pods.uids() {
		if p, ok := byUID[uid]; !ok || p.DeletionTimestamp != nil {
			s.forget(uid)
		}
	}
	for key, ps := range s.state.data.Pods {
		if p, ok := byUID[types.UID(ps.UID)]; !ok || p.DeletionTimestamp != nil || podKey(p) != key {
			delete(s.state.data.Pods, key)
		}
	}
	for uid := range s.deleting {
		if _, ok := byUID[uid]; !ok {
			delete(s.deleting, uid)
		}
	}
	s.pruneArrivals(byUID)

	var fresh []*v1.Pod
	for _, p := range byUID {
		switch {
		case p.DeletionTimestamp != nil:
			s.forceDelete(ctx, p)
		case !s.pods.update(p):
			fresh = append(fresh, p)
		}
	}
	// HandlePodAdditions order: creation time; then the order pods arrived
	// in (creation timestamps have one-second resolution).
	sort.SliceStable(fresh, func(i, j int) bool {
		a, b := fresh[i], fresh[j]
		if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
			return a.CreationTimestamp.Before(&b.CreationTimestamp)
		}
		if ai, bi := s.arrival(a.UID), s.arrival(b.UID); ai != bi {
			return ai < bi
		}
		return podKey(a) < podKey(b)
	})
	for _, p := range fresh {
		if ctx.Err() != nil {
			return
		}
		s.handleAddition(ctx, p)
		s.flushState()
	}
	for _, uid := range s.pods.uids() {
		s.syncPod(ctx, uid)
	}
	s.flushState()
}

// handleAddition is HandlePodAdditions for one pod.
func (s *standin) handleAddition(ctx context.Context, p *v1.Pod) {
	logger := klog.LoggerWithValues(s.logger, "pod", klog.KObj(p), "podUID", p.UID)
	// The pod manager knows the pod before admission: it is in the
	// pod-resources List while the device plugin allocates for it.
	s.pods.add(p)
	if podutil.IsPodPhaseTerminal(p.Status.Phase) {
		s.recordTerminal(p)
		return
	}
	attrs := &lifecycle.PodAdmitAttributes{Pod: p}
	for _, o := range s.pods.active() {
		if o.UID != p.UID {
			attrs.OtherPods = append(attrs.OtherPods, o)
		}
	}
	for _, h := range s.admit {
		if r := h.Admit(attrs); !r.Admit {
			logger.Info("Pod admission denied", "reason", r.Reason, "message", r.Message)
			s.reject(ctx, p, r.Reason, r.Message)
			return
		}
	}
	if ps := s.state.data.Pods[podKey(p)]; s.runningAtStart.Has(p.UID) && ps != nil && ps.UID == string(p.UID) {
		// Its containers kept running while we were down.
		logger.Info("Pod re-admitted, containers already running")
		s.pods.setPhase(p.UID, v1.PodRunning)
		if p.Status.Phase != v1.PodRunning {
			s.setStatus(ctx, p, s.runningStatus(p))
		}
		return
	}
	logger.Info("Pod admitted")
	s.startPod(ctx, p)
}

// reject is kubelet rejectPod.
func (s *standin) reject(ctx context.Context, p *v1.Pod, reason, message string) {
	s.pods.setPhase(p.UID, v1.PodFailed)
	msg := "Pod was rejected: " + message
	s.state.data.Pods[podKey(p)] = &podState{UID: string(p.UID), Phase: string(v1.PodFailed), Reason: reason, Message: msg}
	st := v1.PodStatus{Phase: v1.PodFailed, Reason: reason, Message: msg, QOSClass: qos.GetPodQOS(p),
		Conditions: append([]v1.PodCondition(nil), p.Status.Conditions...)}
	now := metav1.Now()
	for _, t := range []v1.PodConditionType{v1.ContainersReady, v1.PodReady} {
		if _, c := podutil.GetPodConditionFromList(st.Conditions, t); c != nil {
			setCondition(&st, t, v1.ConditionFalse, "PodFailed", now)
		}
	}
	s.setStatus(ctx, p, st)
}

// startPod starts the containers in kubelet order, each through the device
// manager's GetDeviceRunContainerOptions as kubelet generateContainerConfig
// does (PreStartContainer, re-allocation if needed), and records what the
// runtime would have been given.
func (s *standin) startPod(ctx context.Context, p *v1.Pod) {
	logger := klog.LoggerWithValues(s.logger, "pod", klog.KObj(p), "podUID", p.UID)
	key := podKey(p)
	ps := s.state.data.Pods[key]
	if ps == nil || ps.UID != string(p.UID) {
		ps = &podState{UID: string(p.UID)}
		s.state.data.Pods[key] = ps
	}
	if ps.Containers == nil {
		ps.Containers = map[string]*containerState{}
	}
	s.pods.setPhase(p.UID, v1.PodPending)
	for _, c := range podContainers(p) {
		if _, started := ps.Containers[c.Name]; started {
			continue
		}
		opts, err := s.dm.GetDeviceRunContainerOptions(ctx, p, c.Container)
		if err != nil {
			logger.Error(err, "Container start failed, will retry", "container", c.Name)
			ps.Phase, ps.Reason, ps.Message = string(v1.PodPending), "CreateContainerConfigError", err.Error()
			s.retryOf(p.UID).startAt = time.Now().Add(s.cfg.startRetry)
			s.setStatus(ctx, p, s.waitingStatus(p, c.Name, err.Error()))
			return
		}
		cs := containerFacts(opts, s.dm.GetDevices(string(p.UID), c.Name))
		cs.Init = c.init
		ps.Containers[c.Name] = cs
		logger.V(2).Info("Container started", "container", c.Name, "devices", cs.Devices, "env", cs.Env)
	}
	ps.Phase, ps.Reason, ps.Message = string(v1.PodRunning), "", ""
	s.pods.setPhase(p.UID, v1.PodRunning)
	if r := s.retries[p.UID]; r != nil {
		r.startAt = time.Time{}
	}
	logger.Info("Pod running")
	s.setStatus(ctx, p, s.runningStatus(p))
}

// syncPod follows up on a known pod: terminal phases set by others, start
// retries and unpublished statuses.
func (s *standin) syncPod(ctx context.Context, uid types.UID) {
	p, phase, ok := s.pods.get(uid)
	if !ok {
		return
	}
	if podutil.IsPodPhaseTerminal(p.Status.Phase) && !podutil.IsPodPhaseTerminal(phase) {
		s.pods.setPhase(uid, p.Status.Phase)
		s.recordTerminal(p)
		delete(s.retries, uid)
		return
	}
	r := s.retries[uid]
	if r == nil {
		return
	}
	if phase == v1.PodPending && !r.startAt.IsZero() && !time.Now().Before(r.startAt) {
		r.startAt = time.Time{}
		s.startPod(ctx, p)
	}
	if r.status != nil {
		s.publish(ctx, uid)
	}
	if r.status == nil && r.startAt.IsZero() {
		delete(s.retries, uid)
	}
}

func (s *standin) recordTerminal(p *v1.Pod) {
	key := podKey(p)
	ps := s.state.data.Pods[key]
	if ps == nil || ps.UID != string(p.UID) {
		ps = &podState{UID: string(p.UID)}
		s.state.data.Pods[key] = ps
	}
	ps.Phase = string(p.Status.Phase)
	if p.Status.Phase == v1.PodFailed {
		ps.Reason, ps.Message = p.Status.Reason, p.Status.Message
	}
}

// forget drops a deleted (or deleting) pod: no longer active, so the device
// manager frees its devices at its next allocation, and out of the state.
func (s *standin) forget(uid types.UID) {
	if s.pods.remove(uid) {
		s.logger.Info("Pod removed", "podUID", uid)
	}
	delete(s.retries, uid)
	s.forgetArrival(uid)
}

// forceDelete finishes a graceful deletion at once: nothing runs, so there
// is nothing to wait for (the kubelet deletes with grace 0 once stopped).
func (s *standin) forceDelete(ctx context.Context, p *v1.Pod) {
	if t, ok := s.deleting[p.UID]; ok && time.Since(t) < 5*time.Second {
		return
	}
	s.deleting[p.UID] = time.Now()
	err := s.client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		Preconditions:      metav1.NewUIDPreconditions(string(p.UID)),
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		s.logger.Error(err, "Deleting pod", "pod", klog.KObj(p))
	}
}

func (s *standin) retryOf(uid types.UID) *retry {
	r := s.retries[uid]
	if r == nil {
		r = &retry{}
		s.retries[uid] = r
	}
	return r
}

// setStatus is the status manager's SetPodStatus: publish now, retry later.
func (s *standin) setStatus(ctx context.Context, p *v1.Pod, st v1.PodStatus) {
	s.retryOf(p.UID).status = &st
	s.publish(ctx, p.UID)
}

func (s *standin) publish(ctx context.Context, uid types.UID) {
	r := s.retries[uid]
	p, _, ok := s.pods.get(uid)
	if r == nil || r.status == nil || !ok {
		return
	}
	if latest, err := s.podLister.Pods(p.Namespace).Get(p.Name); err == nil && latest.UID == uid {
		p = latest
	}
	updated, _, _, err := statusutil.PatchPodStatus(ctx, s.client, p.Namespace, p.Name, uid, p.Status, *r.status)
	switch {
	case err == nil:
		r.status = nil
		if updated != nil {
			s.pods.update(updated)
		}
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
		r.status = nil // gone or replaced; the informer tells us
	default:
		s.logger.Error(err, "Updating pod status, will retry", "pod", klog.KObj(p))
	}
}

func (s *standin) flushState() {
	if err := s.state.flush(); err != nil {
		s.logger.Error(err, "Writing state file", "path", s.state.path)
	}
}

type podContainer struct {
	*v1.Container
	init, restartable bool
}

// podContainers lists init containers, then app containers: the order the
// kubelet allocates and starts them in.
func podContainers(p *v1.Pod) []podContainer {
	var out []podContainer
	for i := range p.Spec.InitContainers {
		c := &p.Spec.InitContainers[i]
		out = append(out, podContainer{c, true, podutil.IsRestartableInitContainer(c)})
	}
	for i := range p.Spec.Containers {
		out = append(out, podContainer{&p.Spec.Containers[i], false, false})
	}
	return out
}

// runningStatus is what the kubelet reports once every container runs
// (init containers completed, sidecars running).
func (s *standin) runningStatus(p *v1.Pod) v1.PodStatus {
	now := metav1.Now()
	st := s.baseStatus(p, now)
	st.Phase = v1.PodRunning
	for _, t := range []v1.PodConditionType{v1.PodReadyToStartContainers, v1.PodInitialized, v1.ContainersReady, v1.PodReady} {
		setCondition(st, t, v1.ConditionTrue, "", now)
	}
	st.InitContainerStatuses, st.ContainerStatuses = nil, nil
	for _, c := range podContainers(p) {
		cs := v1.ContainerStatus{Name: c.Name, Image: c.Image, ContainerID: containerID(p.UID, c.Name), Ready: true}
		if c.init && !c.restartable {
			cs.State.Terminated = &v1.ContainerStateTerminated{Reason: "Completed", StartedAt: now, FinishedAt: now, ContainerID: cs.ContainerID}
			cs.Started = ptr.To(false)
		} else {
			cs.State.Running = &v1.ContainerStateRunning{StartedAt: now}
			cs.Started = ptr.To(true)
		}
		if c.init {
			st.InitContainerStatuses = append(st.InitContainerStatuses, cs)
		} else {
			st.ContainerStatuses = append(st.ContainerStatuses, cs)
		}
	}
	if utilfeature.DefaultFeatureGate.Enabled(features.ResourceHealthStatus) {
		s.dm.UpdateAllocatedResourcesStatus(p, st)
	}
	return *st
}

// waitingStatus: container `failed` could not be created (the kubelet's
// CreateContainerConfigError); the pod stays Pending.
func (s *standin) waitingStatus(p *v1.Pod, failed, message string) v1.PodStatus {
	now := metav1.Now()
	st := s.baseStatus(p, now)
	st.Phase = v1.PodPending
	setCondition(st, v1.PodReadyToStartContainers, v1.ConditionTrue, "", now)
	initDone := true
	st.InitContainerStatuses, st.ContainerStatuses = nil, nil
	for _, c := range podContainers(p) {
		cs := v1.ContainerStatus{Name: c.Name, Image: c.Image, Started: ptr.To(false)}
		cs.State.Waiting = &v1.ContainerStateWaiting{Reason: "PodInitializing"}
		if c.Name == failed {
			cs.State.Waiting = &v1.ContainerStateWaiting{Reason: "CreateContainerConfigError", Message: message}
			initDone = initDone && !c.init
		}
		if c.init {
			st.InitContainerStatuses = append(st.InitContainerStatuses, cs)
		} else {
			st.ContainerStatuses = append(st.ContainerStatuses, cs)
		}
	}
	setCondition(st, v1.PodInitialized, boolCondition(initDone), "ContainersNotInitialized", now)
	setCondition(st, v1.ContainersReady, v1.ConditionFalse, "ContainersNotReady", now)
	setCondition(st, v1.PodReady, v1.ConditionFalse, "ContainersNotReady", now)
	return *st
}

func (s *standin) baseStatus(p *v1.Pod, now metav1.Time) *v1.PodStatus {
	st := p.Status.DeepCopy()
	st.Reason, st.Message = "", ""
	st.HostIP, st.HostIPs = s.cfg.nodeIP, []v1.HostIP{{IP: s.cfg.nodeIP}}
	if st.StartTime == nil {
		st.StartTime = &now
	}
	st.QOSClass = qos.GetPodQOS(p)
	return st
}

func boolCondition(b bool) v1.ConditionStatus {
	if b {
		return v1.ConditionTrue
	}
	return v1.ConditionFalse
}

// setCondition sets a pod condition, keeping its transition time if the
// status does not change.
func setCondition(st *v1.PodStatus, t v1.PodConditionType, status v1.ConditionStatus, reason string, now metav1.Time) {
	c := v1.PodCondition{Type: t, Status: status, LastTransitionTime: now}
	if status != v1.ConditionTrue {
		c.Reason = reason
	}
	if _, old := podutil.GetPodConditionFromList(st.Conditions, t); old != nil && old.Status == status {
		c.LastTransitionTime = old.LastTransitionTime
	}
	st.Conditions = statusutil.ReplaceOrAppendPodCondition(st.Conditions, &c)
}
