//! The commands a person runs, beside `serve`: [`cli`] (`inspect`, `top`, `why`, also the kubectl
//! plugin `kubectl-nano_gpu`), with [`inspect_table`] and [`top`] rendering their tables; [`check`]
//! (`kubectl nano-gpu check`: is nano-gpu installed and working, and if not, what to do);
//! [`uninstall`] (`kubectl nano-gpu uninstall`).

pub mod check;
pub mod cli;
pub mod inspect_table;
pub mod top;
pub mod uninstall;
