// One binary for the upstream commands a one-node cluster runs (as hyperkube and k3s do): etcd,
// the Kubernetes commands (but kube-proxy: that cluster has none), containerd and its ctr, so
// hack/gpu-node.sh can carry them to a GPU machine: they share most of their code, and apart they
// are two and a half times the size (441 MB against 174 MB, stripped). The command is the first
// argument or the name the binary was called by (a link named kubelet runs the kubelet). Each
// branch is that command's upstream main, unchanged. Built by `hack/gpu-node.sh --build`, which
// writes this module's go.mod from the pinned Kubernetes one (hack/upstream/<minor>/kubernetes),
// etcd's and containerd's.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	containerd "github.com/containerd/containerd/v2/cmd/containerd/command"
	ctr "github.com/containerd/containerd/v2/cmd/ctr/app"
	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
	_ "time/tzdata"

	_ "github.com/containerd/containerd/v2/cmd/containerd/builtins"
	_ "k8s.io/client-go/plugin/pkg/client/auth"
)

var commands = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := commands[name]; !ok && name != "kubectl" && name != "etcd" && name != "containerd" && name != "ctr" && len(os.Args) > 1 {
		name = os.Args[1]
		os.Args = os.Args[1:]
	}
	switch name {
	case "containerd":
		if err := containerd.App().Run(os.Args); err != nil {
			fmt.Fprintf(os.Stderr, "containerd: %s\n", err)
			os.Exit(1)
		}
		return
	case "ctr":
		if err := ctr.New().Run(os.Args); err != nil {
			fmt.Fprintf(os.Stderr, "ctr: %s\n", err)
			os.Exit(1)
		}
		return
	}
	if name == "etcd" {
		etcdmain.Main(os.Args)
		return
	}
	if name == "kubectl" {
		logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) // nolint:errcheck
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	}
	newCommand, ok := commands[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "kube: which command? kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl, etcd, containerd or ctr, not %q\n", name)
		os.Exit(2)
	}
	os.Exit(cli.Run(newCommand()))
}
