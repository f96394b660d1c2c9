//! The run control's state machine, alone: which transition leads where from which state. Pure,
//! so that the table is read and tested in one place; the controller performs the transitions.

use serde::Serialize;

/// The state of the whole system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Nothing loaded.
    Initial,
    /// A topology is loaded and checked; nothing runs.
    Configured,
    /// A run is taking data.
    Running,
    /// A run is open with its triggers held.
    Paused,
    /// The last run ended (by a stop, or by itself); a new one can start.
    Stopped,
    /// A component failed, or a transition could not be carried out; only `reset` leaves it.
    Error,
}

/// What an operator (or the system itself) asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Transition {
    Configure,
    Start,
    Pause,
    Resume,
    Stop,
    Reset,
}

impl Transition {
    pub const ALL: [Transition; 6] = [
        Transition::Configure,
        Transition::Start,
        Transition::Pause,
        Transition::Resume,
        Transition::Stop,
        Transition::Reset,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Transition::Configure => "configure",
            Transition::Start => "start",
            Transition::Pause => "pause",
            Transition::Resume => "resume",
            Transition::Stop => "stop",
            Transition::Reset => "reset",
        }
    }

    pub fn parse(s: &str) -> Option<Transition> {
        Transition::ALL.into_iter().find(|t| t.name() == s)
    }
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Initial => "initial",
            State::Configured => "configured",
            State::Running => "running",
            State::Paused => "paused",
            State::Stopped => "stopped",
            State::Error => "error",
        }
    }

    /// Where `t` leads from here, if it is allowed here.
    pub fn after(self, t: Transition) -> Option<State> {
        use State::*;
        use Transition::*;
        Some(match (self, t) {
            (Initial | Configured | Stopped, Configure) => Configured,
            (Configured | Stopped, Start) => Running,
            (Running, Pause) => Paused,
            (Paused, Resume) => Running,
            (Running | Paused, Stop) => Stopped,
            (Configured | Stopped | Error, Reset) => Initial,
            _ => return None,
        })
    }

    /// The transitions allowed here.
    pub fn allowed(self) -> Vec<Transition> {
        Transition::ALL
            .into_iter()
            .filter(|t| self.after(*t).is_some())
            .collect()
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for Transition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        use State::*;
        use Transition::*;
        let legal = [
            (Initial, Configure, Configured),
            (Configured, Configure, Configured),
            (Configured, Start, Running),
            (Configured, Reset, Initial),
            (Running, Pause, Paused),
            (Running, Stop, Stopped),
            (Paused, Resume, Running),
            (Paused, Stop, Stopped),
            (Stopped, Start, Running),
            (Stopped, Configure, Configured),
            (Stopped, Reset, Initial),
            (Error, Reset, Initial),
        ];
        let all = [Initial, Configured, Running, Paused, Stopped, Error];
        let mut n = 0;
        for s in all {
            for t in Transition::ALL {
                let want = legal.iter().find(|x| x.0 == s && x.1 == t).map(|x| x.2);
                assert_eq!(s.after(t), want, "{s} --{t}-->");
                n += want.is_some() as usize;
            }
        }
        assert_eq!(n, legal.len());
        // A running system is never reset or reconfigured under the run's feet.
        assert!(Running.after(Reset).is_none() && Running.after(Configure).is_none());
        assert_eq!(Error.allowed(), vec![Reset]);
        for t in Transition::ALL {
            assert_eq!(Transition::parse(t.name()), Some(t));
        }
        assert_eq!(Transition::parse("launch"), None);
    }
}
